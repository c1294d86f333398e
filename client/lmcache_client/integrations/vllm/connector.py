"""vLLM V1 KV connector backed by lmcache-server.

Load it with::

    python -m vllm.entrypoints.openai.api_server --model MODEL --kv-transfer-config \\
        '{"kv_connector": "LMCacheServerConnectorV1",
          "kv_connector_module_path": "lmcache_client.integrations.vllm.connector",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {"address": "tcp://127.0.0.1:65432"}}'

Extra config keys (all optional; an unknown key or a bad value is refused at
start): ``address`` (daemon endpoint; default ``$LMCACHE_SERVER_ADDRESS``, else
``tcp://127.0.0.1:65432``), ``timeout_s`` (per daemon call; a slow
or absent daemon is a miss), ``backoff_s`` / ``max_backoff_s`` (how often the
circuit breaker probes a daemon that is down), ``chunk_size`` (tokens per
chunk, default 256), ``model_id`` (names the weights; default vLLM's
``--model``), ``tenant`` (isolates tenants), ``malloc_tuning`` (keep glibc
from re-faulting large receive buffers; default true), ``copy_threads``
(threads that copy chunks in and out of a CPU KV cache and the pool;
default 2), ``store_tails`` (also store each prompt's partial last chunk under
a key naming the exact prompt; always on for ``kv_producer``), ``load_wait_s``
(how long a request waits for chunks a producer is still storing before the
rest is computed; default 5 for ``kv_consumer``, 0 otherwise); for a daemon with
``auth: curve``: ``server_public_key`` and ``client_secret_key`` (see
docs/security.md).

``kv_role``: ``kv_both`` loads and stores, ``kv_producer`` only stores (its
prompts' tails included), ``kv_consumer`` only loads (waiting ``load_wait_s``
for what a producer has not stored yet): prefill/decode disaggregation
through the daemon, see docs/integrations.md.  Failed loads are reported to vLLM
(``get_block_ids_with_load_errors``); with ``kv_load_failure_policy:
recompute`` vLLM recomputes those blocks, with vLLM's default ``fail`` it
fails the request, so the connector warns at start when it sees ``fail``.

The class is a thin shim: the scheduler role runs a
:class:`~.scheduler.SchedulerSide`, the worker role a
:class:`~.worker.WorkerSide` (and, asynchronous, a
:class:`~.worker.transferengine.TransferEngine`); each owns one blocking
client, and a :class:`~.plumbing.Plumbing` makes the clients and lanes.  Under
tensor parallelism each rank stores its own shard (namespace
``tp<rank>of<size>``) and the scheduler's lookup answers for the smallest
hit over all ranks; MLA models store their latent once per node (namespace
``tp0of1``, layout ``L1TC``): rank 0 stores, every rank loads (:mod:`.mla`).  Mamba / GDN hybrids (Qwen3-Next) store
their attention layers as chunks and each boundary's recurrent state beside
them; a hit ends only where a state of exactly that length is stored
(:mod:`.states`).

Primitives: :class:`LMCacheServerConnectorV1`, :class:`ConnectorSettings`,
:func:`layout_from_vllm_config`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ...memtune import tune_malloc
from ..chunklayout import MLAChunkLayout
from ..transfer import ChunkTransfer
from .compat import BASE_TAKES_KV_CACHE_CONFIG, KVConnectorBase_V1, KVConnectorTransferResults, SupportsHMA, tp_rank
from .groups import SLIDING, check_groups, group_infos
from .lanes import Lane
from .meta import LMCacheServerConnectorMetadata
from .params import PROMPT_SOURCES
from .plumbing import Plumbing
from .scheduler import CostGate, SchedulerSide
from .settings import CONSUMER_WAIT_S, ROLES, ConnectorSettings
from .stats import LMCacheServerConnectorStats, prom_metrics_class
from .vllmconfig import connector_events, layout_from_vllm_config, log_through_vllm, state_wiring
from .worker import WorkerSide
from .worker.transferengine import TransferEngine

__all__ = ["ConnectorSettings", "LMCacheServerConnectorV1", "layout_from_vllm_config"]

logger = logging.getLogger(__name__)


class LMCacheServerConnectorV1(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """``KVConnectorBase_V1`` subclass; vLLM builds one per role and process.  It declares
    ``SupportsHMA``: sliding-window models keep vLLM's hybrid KV cache manager (:mod:`.groups`)."""

    # -- vLLM's class-level questions ----------------------------------------------------
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

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        if BASE_TAKES_KV_CACHE_CONFIG:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        else:  # pragma: no cover - vLLM releases before kv_cache_config
            super().__init__(vllm_config=vllm_config, role=role)
        self._kv_cache_config = kv_cache_config
        log_through_vllm()
        transfer_config = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(transfer_config.kv_connector_extra_config)
        self.kv_role = str(getattr(transfer_config, "kv_role", None) or "kv_both")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_role {self.kv_role!r}: expected one of {', '.join(ROLES)}")
        self.layout = layout_from_vllm_config(vllm_config, self.settings.chunk_size)
        self.states = state_wiring(kv_cache_config, self.settings.chunk_size)
        """A Mamba / GDN hybrid's groups (:mod:`.states`); None: no Mamba group."""
        chunk_groups = self.states.attention_config if self.states is not None else kv_cache_config
        check_groups(chunk_groups)  # a group kind it does not understand stops vLLM here
        self.groups = group_infos(chunk_groups) if kv_cache_config is not None else []
        if self.states is not None:  # the chunks hold the attention layers only
            self.layout = dataclasses.replace(self.layout, num_layers=len(self.states.attention_layers))
        kinds = [g.kind for g in self.groups] + ["mamba"] * len(self.states.state_ids if self.states else ())
        if len(kinds) > 1 and not self.settings.async_transfers:
            raise ValueError(
                f"lmcache-server connector: the model has {len(kinds)} KV cache groups "
                f"({', '.join(kinds)}); vLLM takes their load failures only per request, "
                "from asynchronous loads: set async_transfers to true (the default)"
            )
        model_id = self.settings.model_id or str(vllm_config.model_config.model)
        tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        # MLA: one copy per node, one namespace for all ranks (rank 0 stores, every rank loads)
        shards = 1 if isinstance(self.layout, MLAChunkLayout) else tp_size
        is_scheduler = getattr(role, "name", str(role)) == "SCHEDULER"
        if self.settings.malloc_tuning and not is_scheduler:
            tune_malloc()
        self.plumbing = Plumbing(self.settings, self.layout, self.states, self.kv_role)
        plumbing = self.plumbing
        self.client = plumbing.new_client()
        self._reported = {"daemon_failures": 0, "short_circuited": 0}
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self.transfers: TransferEngine | None = None
        """The worker's asynchronous loads and saves (None: synchronous mode or scheduler)."""
        is_async = self.settings.async_transfers

        def namespace_of(rank: int) -> Any:
            return self.layout.namespace(model_id, tp_rank=rank, tp_size=tp_size, tenant=self.settings.tenant)

        if is_scheduler:
            transfers = [plumbing.transfer(self.client, namespace_of(r)) for r in range(shards)]
            wait_s = self.settings.load_wait_s
            if wait_s < 0:
                wait_s = CONSUMER_WAIT_S if self.kv_role == "kv_consumer" else 0.0
            state_transfers = [
                ChunkTransfer(
                    self.client, plumbing.state_namespace(namespace_of(r)), self.states.layout.state_bytes, codec="none"
                )
                for r in range(shards)
                if self.states is not None
            ]
            self.scheduler = SchedulerSide(
                transfers,
                self.settings.chunk_size,
                load=self.kv_role != "kv_producer",
                save=self.kv_role != "kv_consumer",
                store_tails=self.settings.store_tails or self.kv_role == "kv_producer",
                load_wait_s=wait_s,
                lookups=plumbing.lookups([namespace_of(r) for r in range(shards)]) if is_async else None,
                async_load=is_async,
                async_save=is_async,
                save_decode_cache=self.settings.save_decode_cache,
                max_store_tokens=self.settings.max_store_tokens,
                load_deadline_ms=self.settings.load_deadline_ms,
                cost_gate=CostGate(self.settings.cost_gate_margin) if self.settings.cost_gate else None,
                events=connector_events(vllm_config, self.settings.chunk_size),
                groups=self.groups if len(self.groups) > 1 else [],
                states=self.states,
                state_transfers=state_transfers,
            )
            namespace: str = transfers[0].namespace
            policy = str(getattr(transfer_config, "kv_load_failure_policy", "recompute"))
            if policy != "recompute" and self.kv_role != "kv_producer":
                logger.warning(
                    "kv_load_failure_policy is %r: a chunk the daemon loses between lookup and load fails that "
                    'request; set it to "recompute" so vLLM recomputes those blocks instead',
                    policy,
                )
        else:
            transfer = plumbing.transfer(self.client, namespace_of(tp_rank()))
            namespace = transfer.namespace
            self.worker = WorkerSide(
                transfer,
                self.layout,
                copy_threads=self.settings.copy_threads,
                batch_copies=self.settings.batch_copies,
                stores=shards == tp_size or tp_rank() == 0,
                layerwise_bytes=self.settings.layerwise_staging_mb << 20 if self.settings.layerwise_save else 0,
                states=self.states,
                state_namespace=plumbing.state_namespace(namespace_of(tp_rank())) if self.states is not None else None,
            )
            if is_async:
                self.transfers = TransferEngine(
                    self.worker,
                    plumbing.lane("lmcache-load", namespace_of(tp_rank())),
                    plumbing.lane("lmcache-save", namespace_of(tp_rank())),
                    load_deadline_s=self.settings.load_deadline_ms / 1000,
                    max_queued_saves=self.settings.max_queued_saves,
                )
        logger.info(
            "lmcache-server connector (%s, %s) at %s, namespace %s",
            role,
            self.kv_role,
            self.settings.address,
            namespace,
        )

    @property
    def lanes(self) -> list[Lane]:
        """Threads talking to the daemon off vLLM's thread (asynchronous mode)."""
        return self.plumbing.lanes

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a hand-off: a dropped save is only a future miss."""
        return False

    def _meta(self) -> LMCacheServerConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, LMCacheServerConnectorMetadata) else None

    def _worker(self) -> WorkerSide:
        if self.worker is None:
            raise RuntimeError("worker-side method called on the scheduler connector")
        return self.worker

    def _scheduler(self) -> SchedulerSide:
        if self.scheduler is None:
            raise RuntimeError("scheduler-side method called on the worker connector")
        return self.scheduler

    # -- worker side -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        engine = self._worker().register(kv_caches, self._vllm_config, self._kv_cache_config)
        if engine.copier.device.type == "cuda":  # each lane maps the pool on its own: page-lock each mapping
            for lane in self.lanes:
                lane.transfer.client.pin_shared_pool()

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33 sleep mode: the KV caches go away until ``restore_kv_caches``;
        nothing is loaded or stored meanwhile (vLLM schedules nothing then)."""
        if self.transfers is not None:  # nothing may touch the caches once they are unmapped
            self.transfers.load_lane.drain()
            self.transfers.flush_saves()
        self._worker().sleep()

    def restore_kv_caches(self) -> None:
        """vLLM 0.33 wake-up: the same cache tensors are back (vLLM remaps their memory)."""
        self._worker().wake()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Preempted requests' blocks are handed out in this step: the saves reading
        them finish before the forward pass may overwrite them."""
        meta = kv_connector_metadata
        if self.transfers is not None and any(g.kind == SLIDING for g in self.groups):
            # This step's scheduling may have handed out blocks a sliding window left
            # behind, which saves of the last step may still read (groups.py).
            self.transfers.flush_saves()
        elif self.transfers is not None and isinstance(meta, LMCacheServerConnectorMetadata) and meta.preempted:
            self.transfers.flush_saves(meta.preempted)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is None or not meta.loads:
            return
        if self.transfers is not None:
            self.transfers.load(meta.loads, meta.load_deadlines)
        else:
            self._worker().load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # start_load_kv loads every layer before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """``layerwise_save``: copy this layer's tokens of the step's saves out now, while
        the next layers compute (:mod:`.layerwise`); otherwise ``wait_for_save`` gathers
        every layer at once, straight into the daemon's pool."""
        meta = self._meta()
        if meta is not None and meta.saves:
            self._worker().save_layer(meta, meta.saves, layer_name)

    def wait_for_save(self) -> None:
        meta = self._meta()
        if meta is not None and meta.state_saves:  # copied now: vLLM may hand their blocks out next step
            if self.transfers is not None:
                self.transfers.save_states(meta.state_saves)  # stored on the save lane
            else:
                self._worker().save_states(meta.state_saves)
        if meta is None or not meta.saves:
            return
        staged = self._worker().take_staged(meta, meta.saves)
        if self.transfers is not None:
            self.transfers.save(meta.saves, staged)  # only submits: the lane stores them
        else:
            self._worker().save(meta.saves, staged)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Asynchronous loads done (``finished_recving``) and requests whose blocks
        vLLM held for their saves, now done (``finished_sending``)."""
        if self.transfers is None:
            return None, None  # synchronous: nothing outlives a step
        meta = self._meta()
        sending, recving = self.transfers.finished(
            meta.delayed if meta is not None else (), idle=meta.idle if meta is not None else False
        )
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """``get_finished`` plus, with several KV cache groups, the requests whose load
        failed (``failed_recving``: vLLM recomputes them; block-level errors it refuses there)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self.worker.take_failed_requests() if self.worker is not None else set()
        if KVConnectorTransferResults is None:  # pragma: no cover - vLLM without per-request failures
            return sending, recving
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()), finished_recving=set(recving or ()), failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_failed_blocks() if self.worker is not None else set()

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """A load fills every KV cache group (a sliding-window group: the blocks of its window;
        a Mamba group: the state the hit ends with, or the load fails)."""
        return tuple(range(max(1, len(getattr(self._kv_cache_config, "kv_cache_groups", None) or self.groups))))

    def get_kv_connector_stats(self) -> LMCacheServerConnectorStats | None:
        data = self.worker.take_stats() if self.worker is not None else self._scheduler().take_stats()
        clients = [self.client] + [lane.transfer.client for lane in self.lanes]  # each has its own breaker
        failures = sum(int(c.fail_open_stats["failures"]) for c in clients)
        short = sum(int(c.fail_open_stats["short_circuited"]) for c in clients)
        data["daemon_failures"] = failures - self._reported["daemon_failures"]
        data["short_circuited"] = short - self._reported["short_circuited"]
        self._reported = {"daemon_failures": failures, "short_circuited": short}
        stats = LMCacheServerConnectorStats(data=data)
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        for lane in self.lanes:
            lane.close()
        if self.worker is not None:
            self.worker.close()
        self.client.close()

    # -- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens to load beyond vLLM's own hit, and whether the load is asynchronous;
        None (ask again next step) while the lookup is out or a consumer waits for a
        producer's chunks."""
        scheduler = self._scheduler()
        n = scheduler.num_new_matched_tokens(request, num_computed_tokens)
        return n, bool(n) and scheduler.async_load

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler().after_alloc(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' reports of the last step: asynchronous loads that finished."""
        if self.scheduler is not None:
            self.scheduler.loads_finished(set(getattr(connector_output, "finished_recving", None) or ()))
            self.scheduler.saw_output(getattr(connector_output, "kv_connector_stats", None))

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        """The load's tokens by the daemon tier holding them (vLLM's cache-hit-source metrics)."""
        try:
            from vllm.v1.metrics.cache_hit_source import CacheHitSource
        except ImportError:  # pragma: no cover - vLLM without per-source hit metrics
            return {}
        names = {"memory": CacheHitSource.HOST, "disk": CacheHitSource.DISK}
        out: dict[Any, int] = {}
        for tier, tokens in self._scheduler().hit_sources(request.request_id, num_external_tokens).items():
            source = names.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[source] = out.get(source, 0) + tokens
        return out

    def build_connector_meta(self, scheduler_output: Any) -> LMCacheServerConnectorMetadata:
        return self._scheduler().build_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """True (vLLM holds the blocks) while the request's asynchronous saves run; and the
        request's prompt tokens by source (scheduler/sources.py), which vLLM returns with its
        outputs: ``{"lmcache_prompt_sources": {"recomputed": n, "vllm_cache": n, "memory": n, ...}}``."""
        scheduler = self._scheduler()
        sources = scheduler.prompt_sources(request.request_id)
        return scheduler.finished(request.request_id), ({PROMPT_SOURCES: sources} if sources else None)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` with every group's blocks (``SupportsHMA``): vLLM holds all
        of them while the request's asynchronous saves run."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def take_events(self) -> list[Any]:
        """KV events of blocks this replica can load from the daemon (vllm/scheduler/events.py)."""
        events = self._scheduler().events if self.scheduler is not None else None
        return events.take() if events is not None else []
