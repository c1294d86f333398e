"""Tests of the SGLang HiCache backend (lmcache_client.integrations.sglang)."""
