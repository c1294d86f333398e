"""Tests of lmcache_server.storage.remote: the Redis uplink, its admission, its durability."""
