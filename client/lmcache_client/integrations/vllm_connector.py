"""vLLM V1 KV connector backed by lmcache-server.

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "LMCacheServerConnectorV1",
        "kv_connector_module_path": "lmcache_client.integrations.vllm_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"address": "tcp://127.0.0.1:65432", "timeout_s": 2.0}}'

Extra config keys (all optional; an unknown key is refused at start):
``address`` (daemon endpoint), ``timeout_s`` (per daemon call; a slow or
absent daemon is a miss), ``chunk_size`` (tokens per chunk, default 256;
shared prefixes are found at chunk granularity), ``model_id`` (names the
weights; default vLLM's ``--model``), ``tenant`` (isolates tenants);
for a daemon with ``auth: curve``: ``server_public_key`` (the daemon's
public key, Z85 text or key file) and ``client_secret_key`` (this engine's
secret key file, mode 0600; see docs/security.md).

The class is a thin shim: the scheduler role runs a
:class:`~.vllm_scheduler.SchedulerSide`, the worker role a
:class:`~.vllm_worker.WorkerSide`; each owns one blocking client.  Under tensor
parallelism each rank stores its own shard (namespace ``tp<rank>of<size>``),
and the scheduler looks up rank 0's; a rank that then misses reports the
blocks as load errors and vLLM recomputes them.

Primitives: :class:`LMCacheServerConnectorV1`, :class:`ConnectorSettings`,
:func:`layout_from_vllm_config`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ..client import DEFAULT_ADDRESS, CacheClient
from ..namespace import canonical_dtype
from .layout import ChunkLayout
from .transfer import ChunkTransfer
from .vllm_compat import BASE_TAKES_KV_CACHE_CONFIG, KVConnectorBase_V1, tp_rank
from .vllm_meta import LMCacheServerConnectorMetadata
from .vllm_scheduler import SchedulerSide
from .vllm_worker import WorkerSide

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config``, validated once at start."""

    address: str = DEFAULT_ADDRESS
    timeout_s: float = 2.0
    chunk_size: int = 256
    model_id: str = ""
    tenant: str = ""
    server_public_key: str = ""
    client_secret_key: str = ""

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(fields))
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(fields)}")
        values: dict[str, Any] = {}
        for name, value in extra.items():
            kind = type(getattr(cls(), name))
            try:
                values[name] = kind(value)
            except (TypeError, ValueError) as err:
                raise ValueError(f"kv_connector_extra_config {name}={value!r}: expected {kind.__name__}") from err
        settings = cls(**values)
        if settings.timeout_s <= 0 or settings.chunk_size <= 0:
            raise ValueError("kv_connector_extra_config timeout_s and chunk_size must be positive")
        return settings


def layout_from_vllm_config(vllm_config: Any, chunk_size: int) -> ChunkLayout:
    """The payload layout of this engine's shard, from vLLM's model and cache config."""
    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    dtype = canonical_dtype(model_config.dtype) if cache_dtype == "auto" else _fp8_dtype(cache_dtype)
    return ChunkLayout(
        num_layers=model_config.get_num_layers(parallel_config),
        num_kv_heads=model_config.get_num_kv_heads(parallel_config),
        head_dim=model_config.get_head_size(),
        chunk_size=chunk_size,
        dtype=dtype,
    )


def _fp8_dtype(cache_dtype: str) -> str:
    if cache_dtype in ("fp8", "fp8_e4m3"):
        return "float8_e4m3fn"
    if cache_dtype == "fp8_e5m2":
        return "float8_e5m2"
    return canonical_dtype(cache_dtype)


class LMCacheServerConnectorV1(KVConnectorBase_V1):  # type: ignore[misc]
    """``KVConnectorBase_V1`` subclass; vLLM builds one per role and process."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        if BASE_TAKES_KV_CACHE_CONFIG:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        else:  # pragma: no cover - vLLM releases before kv_cache_config
            super().__init__(vllm_config=vllm_config, role=role)
        transfer_config = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(transfer_config.kv_connector_extra_config)
        self.layout = layout_from_vllm_config(vllm_config, self.settings.chunk_size)
        model_id = self.settings.model_id or str(vllm_config.model_config.model)
        tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        is_scheduler = getattr(role, "name", str(role)) == "SCHEDULER"
        rank = 0 if is_scheduler else tp_rank()
        namespace = self.layout.namespace(model_id, tp_rank=rank, tp_size=tp_size, tenant=self.settings.tenant)
        self.client = CacheClient(
            self.settings.address,
            timeout_s=self.settings.timeout_s,
            server_public_key=self.settings.server_public_key or None,
            client_secret_key=self.settings.client_secret_key or None,
        )
        transfer = ChunkTransfer(self.client, namespace, self.layout.nbytes)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if is_scheduler:
            self.scheduler = SchedulerSide(transfer, self.settings.chunk_size)
        else:
            self.worker = WorkerSide(transfer, self.layout)
        logger.info("lmcache-server connector (%s) at %s, namespace %s", role, self.settings.address, namespace)

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a hand-off: a dropped save is only a future miss."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None  # logical indexing works for NHD and HND stride orders alike

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
        self._worker().register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is not None and meta.loads:
            self._worker().load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # start_load_kv loads every layer before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is not None and meta.saves:
            self._worker().save_layer(layer_name, kv_layer, meta.saves)

    def wait_for_save(self) -> None:
        meta = self._meta()
        if meta is not None and meta.saves:
            self._worker().finish_saves(meta.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # nothing is asynchronous past a step

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_failed_blocks() if self.worker is not None else set()

    def shutdown(self) -> None:
        self.client.close()

    # -- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = request.prompt_token_ids
        tokens = self._scheduler().num_new_matched_tokens(request.request_id, prompt, num_computed_tokens)
        return tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler().after_alloc(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> LMCacheServerConnectorMetadata:
        return self._scheduler().build_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler().forget(request.request_id)
        return False, None
