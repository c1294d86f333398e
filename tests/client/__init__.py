"""Tests of the client package (lmcache_client): round trips, fail-open, keys, codec, warmup."""
