"""What the vLLM connector reads from vLLM's config: the payload layout, the Mamba
state wiring, KV events, and where its log lines go (the clients, lanes and
transfers each role builds: :mod:`.plumbing`).

Primitives: :func:`layout_from_vllm_config`, :func:`state_wiring`,
:func:`connector_events`, :func:`log_through_vllm`, :func:`fp8_dtype`.
"""

from __future__ import annotations

import logging
from typing import Any

from ...namespace import canonical_dtype
from ..chunklayout import ChunkLayout, MLAChunkLayout
from .mamba import StateLayout
from .scheduler import ConnectorEvents
from .states import StateWiring


def layout_from_vllm_config(vllm_config: Any, chunk_size: int) -> ChunkLayout:
    """The payload layout of this engine's shard, from vLLM's model and cache config."""
    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    dtype = canonical_dtype(model_config.dtype) if cache_dtype == "auto" else fp8_dtype(cache_dtype)
    if getattr(model_config, "use_mla", False):  # one latent per token and layer, the same on every rank
        return MLAChunkLayout.of(
            model_config.get_num_layers(parallel_config), model_config.get_head_size(), chunk_size, dtype
        )
    return ChunkLayout(
        num_layers=model_config.get_num_layers(parallel_config),
        num_kv_heads=model_config.get_num_kv_heads(parallel_config),
        head_dim=model_config.get_head_size(),
        chunk_size=chunk_size,
        dtype=dtype,
    )


def state_wiring(kv_cache_config: Any, chunk_size: int) -> StateWiring | None:
    """A Mamba / GDN hybrid's wiring, None without Mamba groups (or without vLLM's spec classes)."""
    if kv_cache_config is None or not getattr(kv_cache_config, "kv_cache_groups", None):
        return None
    if not any(type(g.kv_cache_spec).__name__ == "MambaSpec" for g in kv_cache_config.kv_cache_groups):
        return None
    layout = StateLayout.from_kv_cache_config(kv_cache_config)
    return StateWiring(layout, kv_cache_config, chunk_size) if layout is not None else None


def fp8_dtype(cache_dtype: str) -> str:
    if cache_dtype in ("fp8", "fp8_e4m3"):
        return "float8_e4m3fn"
    if cache_dtype == "fp8_e5m2":
        return "float8_e5m2"
    return canonical_dtype(cache_dtype)


def connector_events(vllm_config: Any, chunk_size: int) -> ConnectorEvents | None:
    """The connector's KV events when vLLM publishes KV events (``--kv-events-config``)."""
    events_config = getattr(vllm_config, "kv_events_config", None)
    if events_config is None or not getattr(events_config, "enable_kv_cache_events", False):
        return None
    return ConnectorEvents(int(vllm_config.cache_config.block_size), chunk_size)


def log_through_vllm() -> None:
    """Send this package's INFO lines to vLLM's log handlers when nothing else
    handles them (vLLM configures only its own ``vllm`` logger)."""
    ours = logging.getLogger("lmcache_client")
    if ours.handlers or logging.getLogger().handlers:
        return
    for handler in logging.getLogger("vllm").handlers:
        ours.addHandler(handler)
    if ours.handlers:
        ours.setLevel(logging.INFO)
        ours.propagate = False
