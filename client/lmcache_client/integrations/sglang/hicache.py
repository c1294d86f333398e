"""SGLang HiCache storage backend (the L3 tier) backed by lmcache-server.

Load it with::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "lmcache-server",
            "module_path": "lmcache_client.integrations.sglang.hicache",
            "class_name": "LMCacheServerHiCacheStorage",
            "address": "tcp://127.0.0.1:65432", "timeout_s": 2.0}'

SGLang's ``StorageBackendFactory`` constructs the backend as
``cls(storage_config, kwargs)`` and then hands it its host KV pool
(``register_mem_pool_host``, then ``register_mem_host_pool_v2`` per pool of
the host pool group).  Pages are SGLang's host pages (``page_size`` tokens,
every layer, in the host pool's layout) and are stored as opaque bytes;
SGLang's page hash (a hash chain over the token ids, so it names the whole
prefix) is mapped to a 32-byte key by SHA-256 under a domain string.  The
namespace holds the model name, the TP rank and size (one shared namespace
for MLA models, whose KV is the same on every rank), the pipeline stage and
the context-parallel rank where there are several, the page geometry and
dtype, and the host pool layout, so pages from an incompatible pool are never
read.

Extra config keys besides SGLang's: ``address``, ``timeout_s``, ``tenant``,
``model_id`` (default: SGLang's model name), and for a daemon with
``auth: curve`` ``server_public_key`` and ``client_secret_key`` (Z85 text or
key file paths; docs/security.md).  A daemon that is down or slow is a miss
(``get`` -> None, ``exists`` -> False, ``set`` -> False).  SGLang calls the
backend from its prefetch and backup threads at once, so each thread gets
its own client.

KV codec: the daemon's announced codec (``kv_codec``, docs/codec.md) is used
when it is lossless, on the page bytes as they are; a lossy one (int8,
cachegen) needs the ``(layers, 2, tokens, heads, dim)`` layout, which no
SGLang host layout is, so it is refused with one log line and pages are
stored raw (in the raw namespace).

Hybrid models: the Mamba and SWA pools of a host pool group are stored too,
each in a namespace of its own, through SGLang's ``batch_exists_v2`` /
``batch_get_v2`` / ``batch_set_v2`` (:mod:`.pools`); other side pools (DSA
indexer, DeepSeek V4, draft sidecars) are refused when SGLang registers them,
as are host pools without SGLang's flat-page interface and decode context
parallelism (DCP).

Primitives: :class:`LMCacheServerHiCacheStorage` (the generic page interface
``get``, ``batch_get``, ``set``, ``batch_set``, ``exists``, ``batch_exists``;
the zero-copy interface ``batch_get_v1`` and ``batch_set_v1``, which SGLang
uses with ``"interface_v1": 1``; the v2 calls of hybrid models;
``clear``, ``get_stats``, ``close``) and :func:`page_key`.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any

from ...client import DEFAULT_ADDRESS, CacheClient
from ...curve import CurveKeys
from ...errors import ClientError
from ...memtune import tune_malloc
from ...namespace import Namespace, canonical_dtype
from ...tensors import tensor_bytes
from ..chunklayout import ChunkLayout
from ..transfer import ChunkTransfer
from .pools import SidePool, SidePools
from .stats import TransferStats

logger = logging.getLogger(__name__)

try:  # pragma: no cover - exercised only where SGLang is installed
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
except ImportError:

    class HiCacheStorage:  # type: ignore[no-redef]
        """Local stand-in for SGLang's abstract base when SGLang is absent."""


PAGE_KEY_DOMAIN = b"lmcache-sglang-page-v1"
_SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")
_OUR_KEYS = ("address", "timeout_s", "tenant", "model_id", "server_public_key", "client_secret_key", "malloc_tuning")
_KV_POOL = "kv"
"""SGLang's ``PoolName.KV``: the one host pool this backend stores."""


def page_key(page_hash: str) -> bytes:
    """The daemon key of one SGLang page hash."""
    return hashlib.sha256(PAGE_KEY_DOMAIN + page_hash.encode()).digest()


def _page_over(view: memoryview, dtype: Any, shape: Any) -> Any:
    """A tensor of ``dtype`` and ``shape`` over the page bytes ``view`` (no copy)."""
    import torch

    # The client's views (a leased pool slot, a received frame) are writable.
    return torch.frombuffer(view, dtype=torch.uint8).view(dtype).view(shape)


def _bytes_layout(page: Any, page_size: int) -> ChunkLayout | None:
    """A stand-in (1, 2, page_size, 1, n) layout holding a page's elements, for a lossless
    codec (which sees only the bytes); None when no such shape fits the page or the
    codec does not take its dtype."""
    elements = int(page.numel())
    dtype = str(page.dtype).removeprefix("torch.")
    if dtype not in ("float32", "float16", "bfloat16") or elements % (2 * page_size):
        return None
    return ChunkLayout(1, 1, elements // (2 * page_size), page_size, dtype)


class LMCacheServerHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """A ``HiCacheStorage`` whose pages live in the lmcache-server daemon."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None):
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        unknown = sorted(set(extra) - set(_SGLANG_KEYS) - set(_OUR_KEYS))
        if unknown:
            raise ValueError(f"unknown hicache storage extra config keys {unknown}; ours: {list(_OUR_KEYS)}")
        if int(storage_config.dcp_size) > 1:
            raise ValueError(
                "lmcache-server HiCache storage does not support decode context parallelism (dcp_size > 1)"
            )
        self.address = str(extra.get("address", DEFAULT_ADDRESS))
        self.timeout_s = float(extra.get("timeout_s", 2.0))
        self.tenant = str(extra.get("tenant", ""))
        self.server_public_key = str(extra.get("server_public_key") or "") or None
        self.client_secret_key = str(extra.get("client_secret_key") or "") or None
        # Refuse bad keys here, at start, not later in a prefetch thread.
        CurveKeys.from_options(self.server_public_key, self.client_secret_key)
        tuning = extra.get("malloc_tuning", True)
        if not isinstance(tuning, bool):
            raise ValueError(f"hicache storage extra config 'malloc_tuning': expected true or false, got {tuning!r}")
        if tuning:  # received pages are large: keep glibc from unmapping and re-faulting each buffer
            tune_malloc()
        self.model_id = str(extra.get("model_id") or storage_config.model_name or "")
        if not self.model_id:
            raise ValueError("no model name: SGLang passes --model-path, or set model_id in the extra config")
        self.is_mla = bool(storage_config.is_mla_model)
        self.tp_rank = 0 if self.is_mla else int(storage_config.tp_rank)
        self.tp_size = 1 if self.is_mla else int(storage_config.tp_size)
        # Pipeline stages hold different layers and context-parallel ranks
        # different slices of each page, under the same page hashes.
        self.shard_tags = [
            f"{name}{rank}of{size}"
            for name, rank, size in (
                ("pp", storage_config.pp_rank, storage_config.pp_size),
                ("cp", storage_config.attn_cp_rank, storage_config.attn_cp_size),
            )
            if int(size) > 1
        ]
        self.stats = TransferStats() if storage_config.enable_storage_metrics else None
        self._engine_tp = (int(storage_config.tp_rank), int(storage_config.tp_size))  # Mamba state: per rank
        self.side_pools = SidePools(page_key)
        self.namespace: str | None = None
        """The raw pages' namespace; with a lossless codec pages go to its own (``codec=...``)."""
        self._namespace: Namespace | None = None
        self._codec_layout: ChunkLayout | None = None
        self.mem_pool_host: Any = None
        self.page_bytes = 0
        self.page_size = 0
        self._local = threading.local()
        self._clients: list[CacheClient] = []
        self._lock = threading.Lock()

    # -- setup ---------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang's host KV pool: its page geometry completes the namespace."""
        try:  # the generic and the zero-copy path both go through SGLang's flat pages
            dummy = mem_pool_host.get_dummy_flat_data_page()
            mem_pool_host.get_data_page(0, flat=False)
        except (NotImplementedError, ValueError) as err:
            raise ValueError(
                f"lmcache-server HiCache storage needs SGLang's flat host pages, which "
                f"{type(mem_pool_host).__name__} (layout {mem_pool_host.layout}) does not offer: {err}"
            ) from err
        self.mem_pool_host = mem_pool_host
        self.page_bytes = dummy.numel() * dummy.element_size()
        self.page_size = int(mem_pool_host.page_size)
        if self.is_mla:
            heads, dim = 1, int(mem_pool_host.kv_cache_dim)
        else:
            heads, dim = int(mem_pool_host.head_num), int(mem_pool_host.head_dim)
        layout = "-".join(["sglang", *(["mla"] if self.is_mla else []), mem_pool_host.layout, *self.shard_tags])
        namespace = Namespace(
            model=self.model_id,
            dtype=canonical_dtype(mem_pool_host.dtype),
            num_layers=int(mem_pool_host.layer_num),
            num_kv_heads=heads,
            head_dim=dim,
            chunk_size=self.page_size,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            tenant=self.tenant,
            layout=layout,
        )
        self.namespace = namespace.wire()
        self._namespace = namespace
        self._codec_layout = _bytes_layout(dummy, self.page_size)
        logger.info("lmcache-server HiCache storage at %s, namespace %s", self.address, self.namespace)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Each pool of SGLang's host pool group: KV (the one register_mem_pool_host
        gave), Mamba and SWA, each in its own namespace; others are refused."""
        if str(host_pool_name) == _KV_POOL:
            return
        if self._namespace is None:
            raise RuntimeError("register_mem_pool_host was not called")
        self.side_pools.add(SidePool.register(str(host_pool_name), host_pool, self._namespace, *self._engine_tp))

    def _transfer(self) -> ChunkTransfer:
        """This thread's client, wrapped for batched, size-checked page transfers."""
        transfer: ChunkTransfer | None = getattr(self._local, "transfer", None)
        if transfer is None:
            if self.namespace is None:
                raise RuntimeError("register_mem_pool_host was not called")
            client = CacheClient(
                self.address,
                timeout_s=self.timeout_s,
                server_public_key=self.server_public_key,
                client_secret_key=self.client_secret_key,
            )
            with self._lock:
                self._clients.append(client)
            assert self._namespace is not None
            transfer = self._local.transfer = ChunkTransfer(
                client,
                self._namespace,
                self.page_bytes,
                codec_layout=self._codec_layout,
                lossy_ok=False,  # the page is in SGLang's host layout, not (layers, 2, tokens, heads, dim)
            )
        return transfer

    def close(self) -> None:
        with self._lock:
            for client in self._clients:
                client.close()
            self._clients.clear()

    # -- reads ---------------------------------------------------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """The page, copied into ``target_location`` (a flat host page tensor), or None."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """Pages into ``target_locations``; None from the first page that is missing
        (SGLang uses the leading run only), or of a size that does not fit."""
        started = time.perf_counter()
        given = list(target_locations) if target_locations is not None else [None] * len(keys)
        targets: list[Any] = []
        for target in given:
            if target is None:
                target = self.mem_pool_host.get_dummy_flat_data_page()
            if target.numel() * target.element_size() != self.page_bytes or not target.is_contiguous():
                logger.warning(
                    "page target of %s elements does not hold a %d-byte page", target.numel(), self.page_bytes
                )
                break
            targets.append(target)
        # over shared memory: one copy, from the daemon's pool into the page
        loaded = self._transfer().get_prefix_into([page_key(k) for k in keys[: len(targets)]], targets)
        self._record("prefetch", loaded, started)
        return targets[:loaded] + [None] * (len(keys) - loaded)

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Zero-copy get: each page straight into its host pool slots (``host_indices``
        holds ``page_size`` slots per key); True for the leading pages loaded."""
        started = time.perf_counter()
        starts = self._page_starts(keys, host_indices)
        pool = self.mem_pool_host

        def scatter(i: int, view: memoryview) -> None:
            dest = pool.get_data_page(starts[i], flat=False)  # a view into the host pool
            dest.copy_(_page_over(view, dest.dtype, dest.shape))

        loaded = self._transfer().get_prefix_with([page_key(k) for k in keys], scatter) if keys else 0
        self._record("prefetch", loaded, started)
        return [True] * loaded + [False] * (len(keys) - loaded)

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        """Hybrid models: each transfer's pages into its host pool (KV as ``batch_get_v1``);
        per pool, True per page loaded."""
        results: dict[str, list[bool]] = {}
        for t in transfers:
            name = str(t.name)
            if name == _KV_POOL:
                results[name] = self.batch_get_v1(list(t.keys or ()), t.host_indices)
            else:
                results[name] = self.side_pools.get(self._transfer().client, t)
        return results

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """Hybrid models: the longest prefix of ``keys`` every pool can restore, with
        SGLang's hit policies (``PoolTransferResult``)."""
        kv_pages = self.batch_exists(keys)
        return self.side_pools.exists(self._transfer().client, keys, kv_pages, list(pool_transfers or ()))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages of ``keys`` are stored."""
        return self._transfer().lookup([page_key(k) for k in keys]) if keys else 0

    # -- writes --------------------------------------------------------------------------
    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        if value is None:
            return False
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store pages (flat tensors); True if every one is stored (now or before)."""
        if values is None or len(values) != len(keys):
            return False
        for value in values:
            if value.numel() * value.element_size() != self.page_bytes:
                logger.warning("refusing a %d-element page: pages are %d bytes", value.numel(), self.page_bytes)
                return False
        started = time.perf_counter()
        payloads = [tensor_bytes(v.detach().cpu()) for v in values]
        stored = self._transfer().put([page_key(k) for k in keys], payloads)
        self._record("backup", stored, started)
        return stored == len(keys)

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Zero-copy set: each page gathered from its host pool slots straight into the
        daemon's pool slot (over shared memory).  All True when every page is stored
        (now or before), else all False (SGLang fails the batch on any False)."""
        started = time.perf_counter()
        starts = self._page_starts(keys, host_indices)
        pool = self.mem_pool_host

        def gather(i: int, view: memoryview) -> None:
            src = pool.get_data_page(starts[i], flat=False)
            _page_over(view, src.dtype, src.shape).copy_(src)

        stored = self._transfer().put_with([page_key(k) for k in keys], gather) if keys else 0
        self._record("backup", stored, started)
        return [stored == len(keys)] * len(keys)

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        """Hybrid models: each transfer's pages from its host pool (KV as ``batch_set_v1``);
        per pool, True per page stored (now or before)."""
        results: dict[str, list[bool]] = {}
        for t in transfers:
            name = str(t.name)
            if name == _KV_POOL:
                results[name] = self.batch_set_v1(list(t.keys or ()), t.host_indices)
            else:
                results[name] = self.side_pools.set(self._transfer().client, t)
        return results

    def _page_starts(self, keys: list[str], host_indices: Any) -> list[int]:
        """The first host slot of each key's page."""
        if self.namespace is None:
            raise RuntimeError("register_mem_pool_host was not called")
        if host_indices.numel() != len(keys) * self.page_size:
            raise ValueError(
                f"{len(keys)} pages need {len(keys) * self.page_size} host slots, got {host_indices.numel()}"
            )
        return [int(slot) for slot in host_indices[:: self.page_size].tolist()]

    def clear(self) -> bool:
        """Remove every page of this namespace (other models' and tenants' pages stay)."""
        transfer = self._transfer()
        transfer.binding()  # the codec's namespace, if the daemon announces one
        try:
            removed = transfer.client.clear(namespace=transfer.namespace)
        except ClientError as err:
            logger.warning("lmcache clear failed (%s)", err)
            return False
        logger.info("cleared %d pages from lmcache-server", removed)
        return True

    # -- metrics -------------------------------------------------------------------------
    def _record(self, op: str, pages: int, started: float) -> None:
        if self.stats is not None and pages:
            self.stats.add(op, pages, self.page_bytes, started)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages and GB/s per
        prefetch and backup call), with ``enable_storage_metrics``; else None."""
        if self.stats is None:
            return None
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return None
        taken = self.stats.take()
        metrics = StorageMetrics()
        metrics.prefetch_pgs.extend(pages for pages, _ in taken["prefetch"])
        metrics.prefetch_bandwidth.extend(rate for _, rate in taken["prefetch"])
        metrics.backup_pgs.extend(pages for pages, _ in taken["backup"])
        metrics.backup_bandwidth.extend(rate for _, rate in taken["backup"])
        return metrics
