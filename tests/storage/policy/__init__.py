"""Tests of lmcache_server.storage.policy: eviction policies, the key history, the offline bounds."""
