"""The connector's counters in vLLM's own connector metrics.

vLLM collects ``get_kv_connector_stats()`` from every worker and from the
scheduler each step, aggregates them, logs them periodically (``KV Transfer
metrics: ...``) and hands them to the connector's Prometheus metrics.  Ours
are plain counters (sums over the interval):

| counter | side | meaning |
|---|---|---|
| ``lookups`` | scheduler | prompts looked up in the daemon |
| ``lookup_hit_tokens`` | scheduler | tokens vLLM was told to load (beyond its own prefix cache) |
| ``lookup_s`` | scheduler | seconds spent in lookups |
| ``load_waits`` / ``load_wait_s`` | scheduler | requests that waited for a producer, seconds waited |
| ``load_wait_expired`` | scheduler | waits that reached ``load_wait_s`` (the rest computed) |
| ``loaded_tokens`` / ``load_failed_tokens`` | worker | tokens loaded / that had to be recomputed |
| ``loaded_bytes`` / ``load_s`` | worker | payload bytes read and seconds spent loading |
| ``stored_chunks`` / ``stored_bytes`` / ``store_s`` | worker | chunks (a tail is one) stored or found, bytes, seconds |
| ``load_retries_refused`` | scheduler | requests computed because their asynchronous load failed from its first block |
| ``loads_skipped_by_cost`` | scheduler | loads skipped because loading was slower than computing (``cost_gate``) |
| ``loads_cut_by_cost`` | scheduler | loads cut short: their slower-tier rest computed instead (``cost_gate``) |
| ``load_tokens_skipped_by_cost`` | scheduler | tokens computed instead of loaded by those two (``cost_gate``) |
| ``load_deadline_missed`` | worker | loads that used only what arrived by ``load_deadline_ms`` |
| ``saves_dropped`` | worker | saves not made because ``max_queued_saves`` were queued (a slow daemon) |
| ``stored_states`` | worker | Mamba / GDN states stored (hybrid models, :mod:`.states`) |
| ``layerwise_saves`` | worker | saves copied out layer by layer during the forward pass (``layerwise_save``) |
| ``layerwise_fallbacks`` | worker | saves gathered after the forward pass instead (``layerwise_save`` on) |
| ``state_lookups_in_step`` | scheduler | Mamba state lookups inside vLLM's step (sync mode; TP ranks disagreeing) |
| ``saves_out_of_window`` | scheduler | requests whose saves stopped (a sliding window freed a chunk's blocks) |
| ``daemon_failures`` / ``short_circuited`` | both | calls finding the daemon down / misses from the breaker |
| ``prompt_tokens_<source>`` | scheduler | admitted prompts' tokens by source (``scheduler/sources.py``) |

In Prometheus they appear as ``vllm:lmcache_server_<counter>_total`` with
vLLM's per-engine labels, except the prompt token sources: one counter
``vllm:lmcache_server_prompt_tokens_total`` with a ``source`` label.

Primitives: :class:`LMCacheServerConnectorStats`, :func:`prom_metrics_class`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .compat import KVConnectorPromMetrics, KVConnectorStats
from .scheduler.sources import SOURCES, STAT_PREFIX

COUNTERS = {
    "lookups": "Prompts looked up in lmcache-server",
    "lookup_hit_tokens": "Tokens vLLM loaded from lmcache-server instead of computing them (scheduled)",
    "lookup_s": "Seconds the scheduler spent in lmcache-server lookups",
    "load_waits": "Requests that waited for a producer's chunks (load_wait_s)",
    "load_wait_s": "Seconds requests waited for a producer's chunks",
    "load_wait_expired": "Waits for a producer's chunks that reached the deadline (the rest was computed)",
    "loaded_tokens": "Tokens loaded from lmcache-server into the KV cache",
    "load_failed_tokens": "Tokens whose load failed and that vLLM recomputed",
    "loaded_bytes": "Payload bytes read from lmcache-server",
    "load_s": "Seconds workers spent loading KV from lmcache-server",
    "stored_chunks": "Chunks stored in lmcache-server (or found there already)",
    "stored_bytes": "Payload bytes stored in lmcache-server",
    "store_s": "Seconds workers spent storing KV in lmcache-server",
    "load_retries_refused": "Requests computed in full because their asynchronous load failed from its first block",
    "loads_skipped_by_cost": "Loads skipped because lmcache-server loaded slower than the engine computes (cost_gate)",
    "loads_cut_by_cost": "Loads whose slower-tier rest was computed instead of loaded (cost_gate)",
    "load_tokens_skipped_by_cost": "Tokens computed instead of loaded because loading them was slower (cost_gate)",
    "load_deadline_missed": "Loads that used only the chunks that arrived by their deadline (load_deadline_ms)",
    "saves_dropped": "Saves not made because max_queued_saves saves were queued (a slow daemon)",
    "stored_states": "Mamba / GDN states stored in lmcache-server (hybrid models)",
    "layerwise_saves": "Saves copied out of the KV cache layer by layer during the forward pass (layerwise_save)",
    "layerwise_fallbacks": "Saves gathered after the forward pass although layerwise_save is on",
    "state_lookups_in_step": "Mamba state lookups made inside vLLM's step (synchronous mode, or TP ranks disagreeing)",
    "saves_out_of_window": "Requests whose saves stopped because a sliding-window group freed a chunk's blocks first",
    "daemon_failures": "lmcache-server calls that found the daemon down, slow or draining",
    "short_circuited": "lmcache-server calls answered as misses by the open circuit breaker",
}

PROMPT_TOKENS_DOC = (
    "Prompt tokens of admitted requests by source: recomputed, vllm_cache (vLLM's prefix cache), "
    "or the lmcache-server tier they were loaded from (memory, disk, redis)"
)


@dataclasses.dataclass
class LMCacheServerConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """Counters of one interval; ``data`` maps a counter name to its sum."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: Any) -> LMCacheServerConnectorStats:
        for name, value in (other.data or {}).items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: round(v, 4) if isinstance(v, float) else v for k, v in self.data.items()}
        if self.data.get("load_s"):
            out["load_MiB_per_s"] = round(self.data.get("loaded_bytes", 0) / self.data["load_s"] / 2**20, 1)
        if self.data.get("store_s"):
            out["store_MiB_per_s"] = round(self.data.get("stored_bytes", 0) / self.data["store_s"] / 2**20, 1)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


def prom_metrics_class() -> Any:
    """A ``KVConnectorPromMetrics`` subclass with one counter per :data:`COUNTERS`
    entry (None without vLLM)."""
    if KVConnectorPromMetrics is None:
        return None

    class LMCacheServerPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
        def __init__(
            self,
            vllm_config: Any,
            metric_types: dict[Any, Any],
            labelnames: list[str],
            per_engine_labelvalues: dict[int, list[object]],
        ):
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self._counters: dict[tuple[int, str], Any] = {}
            for name, doc in COUNTERS.items():
                counter = self._counter_cls(
                    name=f"vllm:lmcache_server_{name}", documentation=doc, labelnames=labelnames
                )
                for engine, values in per_engine_labelvalues.items():
                    self._counters[(engine, name)] = counter.labels(*values)
            self._values = per_engine_labelvalues
            self._sources = self._counter_cls(
                name="vllm:lmcache_server_prompt_tokens",
                documentation=PROMPT_TOKENS_DOC,
                labelnames=[*labelnames, "source"],
            )
            for engine, values in per_engine_labelvalues.items():
                for source in SOURCES:  # present from the start, so rate() sees the first increase
                    self._counters[(engine, STAT_PREFIX + source)] = self._sources.labels(*values, source)

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            for name, value in transfer_stats_data.items():
                counter = self._counters.get((engine_idx, name))
                if counter is None and name.startswith(STAT_PREFIX) and engine_idx in self._values:
                    source = name.removeprefix(STAT_PREFIX)  # another daemon tier
                    counter = self._counters[(engine_idx, name)] = self._sources.labels(
                        *self._values[engine_idx], source
                    )
                if counter is not None and value:
                    counter.inc(value)

    return LMCacheServerPromMetrics
