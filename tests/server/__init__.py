"""Tests of lmcache_server.server: the wire, in-flight limits, lifecycle, supervision, prefetch, the cache API."""
