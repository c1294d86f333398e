"""Engine adapters: the daemon as a prefix KV cache for inference engines.

Each adapter is its own module (an engine with several parts, its own
subpackage) and imports its engine lazily, so importing
this package needs neither torch, transformers, vLLM nor SGLang:

- :mod:`.hf`: :class:`~.hf.CachedPrefill` for Hugging Face transformers
  causal LMs (the reference integration; runs on CPU).
- :mod:`.vllm`: :class:`LMCacheServerConnectorV1` in :mod:`.vllm.connector`, a
  vLLM V1 KV connector (``--kv-transfer-config``); the room also holds its
  scheduler and worker sides, its metadata, layout discovery, stats and events.
- :mod:`.sglang`: :class:`LMCacheServerHiCacheStorage` in :mod:`.sglang.hicache`,
  an SGLang HiCache storage backend (``--hicache-storage-backend dynamic``).

:mod:`.vllm_connector` and :mod:`.sglang_hicache` are deprecated aliases of the
two engine modules, kept for engine configs written before the move.

Shared plumbing: :mod:`.chunklayout` (the chunk payload layout shared by the HF and
vLLM adapters), :mod:`.transfer` (batched, validated chunk get/put), :mod:`.coded`
(its KV codec path) and :mod:`.paged` (copies between paged KV caches and chunks).
"""
