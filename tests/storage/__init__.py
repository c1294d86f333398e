"""Tests of lmcache_server.storage: the tiered store, the Redis tier, quotas, durability."""
