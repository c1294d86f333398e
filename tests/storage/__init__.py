"""Tests of lmcache_server.storage: the tiered store, quotas, sizing, state files; each tier in its folder."""
