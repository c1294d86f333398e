"""Tests of lmcache_server.storage.disk: the disk tier, its write path, snapshot and crash consistency."""
