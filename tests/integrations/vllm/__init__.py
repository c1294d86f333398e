"""Tests of the vLLM connector (lmcache_client.integrations.vllm), with stand-ins and with real vLLM."""
