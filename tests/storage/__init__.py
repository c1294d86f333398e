"""Tests of lmcache_server.storage: the tiered store, quotas, sizing, state files; the tiers in memory/, disk/, remote/, policy/."""
