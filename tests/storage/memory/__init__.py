"""Tests of lmcache_server.storage.memory: the pool allocator, entries, eviction, warm restarts."""
