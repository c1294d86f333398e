"""Engine adapters: the daemon as a prefix KV cache for inference engines.

Each adapter is its own module and imports its engine lazily, so importing
this package needs neither torch, transformers, vLLM nor SGLang:

- :mod:`.hf`: :class:`~.hf.CachedPrefill` for Hugging Face transformers
  causal LMs (the reference integration; runs on CPU).
- :mod:`.vllm_connector`: :class:`LMCacheServerConnectorV1`, a vLLM V1 KV
  connector (``--kv-transfer-config``); its parts are :mod:`.vllm_scheduler`,
  :mod:`.vllm_worker`, :mod:`.vllm_meta` and the paged-layout copies in :mod:`.paged`.
- :mod:`.sglang_hicache`: :class:`LMCacheServerHiCacheStorage`, an SGLang
  HiCache storage backend (``--hicache-storage-backend dynamic``).

Shared plumbing: :mod:`.layout` (the chunk payload layout shared by the HF and
vLLM adapters) and :mod:`.transfer` (batched, validated chunk get/put).
"""
