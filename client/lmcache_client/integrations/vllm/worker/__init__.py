"""The vLLM connector's worker-process side: chunks in and out of vLLM's paged KV cache.

- :mod:`.workerside`: :class:`WorkerSide`, the front the connector holds; it
  builds its parts at ``register_kv_caches``;
- :mod:`.chunkcopies`: the one copy mechanism loads and saves share
  (:class:`~.chunkcopies.CacheCopies`, :class:`~.chunkcopies.ChunkCopies`);
- :mod:`.loads`, :mod:`.saves`: the worker's loads and saves;
- :mod:`.payloads`: chunk payloads as tensors over the daemon's bytes;
- :mod:`.layerwise`: layer-wise saves (``layerwise_save``);
- :mod:`.statemover`: a Mamba hybrid's states beside the chunks;
- :mod:`.transferengine`: the asynchronous loads and saves on lanes;
- :mod:`.workerstats`: what the worker moved.

What both vLLM processes share (settings, meta, groups, layout, compat, ...)
stays one floor up, in :mod:`lmcache_client.integrations.vllm`.  Importing
this package imports neither vLLM nor torch.

Primitives: :class:`WorkerSide`, :class:`LoadResult`, :class:`WorkerStats`.
"""

from __future__ import annotations

from .workerside import WorkerSide as WorkerSide
from .workerstats import LoadResult as LoadResult
from .workerstats import WorkerStats as WorkerStats

__all__ = ["LoadResult", "WorkerSide", "WorkerStats"]
