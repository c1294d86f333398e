"""How the vLLM connector is put together from vLLM's config: the payload layout, the
Mamba state wiring, KV events, logging, and the clients, lanes and transfers each role
builds (:class:`Plumbing`, a base of :class:`~.connector.LMCacheServerConnectorV1`).

Primitives: :func:`layout_from_vllm_config`, :func:`state_wiring`,
:func:`connector_events`, :func:`log_through_vllm`, :class:`Plumbing`.
"""

from __future__ import annotations

import logging
from typing import Any

from ...client import CacheClient
from ...namespace import canonical_dtype
from ..layout import ChunkLayout, MLAChunkLayout
from ..transfer import ChunkTransfer
from .events import ConnectorEvents
from .lanes import Lane
from .lookups import LookupService
from .mamba import StateLayout
from .settings import ConnectorSettings
from .states import StateWiring
from .stats import LMCacheServerConnectorStats, prom_metrics_class


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


class Plumbing:
    """The connector's factories of clients, transfers and lanes (one client per thread),
    and its answers to vLLM's class-level questions."""

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None  # the layout is read from the attention backend at register_kv_caches

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise saves run between the layers: CUDA graphs must be piecewise then."""
        return ConnectorSettings.from_extra_config(extra_config).layerwise_save

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> LMCacheServerConnectorStats:
        return LMCacheServerConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        metrics = prom_metrics_class()
        return None if metrics is None else metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    settings: ConnectorSettings
    layout: ChunkLayout
    states: StateWiring | None
    lanes: list[Lane]
    kv_role: str

    def _state_namespace(self, kv: Any) -> str:
        """The Mamba states' namespace beside the chunks' ``kv`` (:meth:`.mamba.StateLayout.namespace`)."""
        assert self.states is not None
        return self.states.layout.namespace(kv).wire()

    def _new_client(self) -> CacheClient:
        s = self.settings
        return CacheClient(
            s.address,
            timeout_s=s.timeout_s,
            copy_threads=s.copy_threads,
            backoff_s=s.backoff_s,
            max_backoff_s=s.max_backoff_s,
            server_public_key=s.server_public_key or None,
            client_secret_key=s.client_secret_key or None,
        )

    def _transfer(self, client: CacheClient, namespace: Any) -> ChunkTransfer:
        return ChunkTransfer(
            client,
            namespace,
            self.layout.nbytes,
            codec_layout=self.layout,  # encodes with the codec the daemon announces (docs/codec.md)
            codec=self.settings.codec or None,
        )

    def _lane(self, name: str, namespace: Any) -> Lane:
        """A thread with a client of its own (a client is not thread-safe)."""
        lane = Lane(name, self._transfer(self._new_client(), namespace))
        self.lanes.append(lane)
        return lane

    def _lookups(self, namespaces: list[Any]) -> LookupService:
        lanes = [self._lane(f"lmcache-lookup-{rank}", ns) for rank, ns in enumerate(namespaces)]
        # A prefetch readies a load; a producer never loads.
        return LookupService(lanes, prefetch=self.settings.prefetch and self.kv_role != "kv_producer")
