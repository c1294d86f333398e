"""Tests of lmcache_client.integrations: the HF adapter, paged layouts, transfer, the codec wiring."""
