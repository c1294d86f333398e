"""SGLang HiCache storage backend (the L3 tier) backed by lmcache-server.

Load it with::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "lmcache-server",
            "module_path": "lmcache_client.integrations.sglang_hicache",
            "class_name": "LMCacheServerHiCacheStorage",
            "address": "tcp://127.0.0.1:65432", "timeout_s": 2.0}'

SGLang constructs the backend as ``cls(storage_config, kwargs)`` and then hands
it its host KV pool (``register_mem_pool_host``).  Pages are SGLang's host
pages (``page_size`` tokens, every layer, in the host pool's layout) and are
stored as opaque bytes; SGLang's page hash (a hash chain over the token ids,
so it names the whole prefix) is mapped to a 32-byte key by SHA-256 under a
domain string.  The namespace holds the model name, the TP rank and size (one
shared namespace for MLA models, whose KV is the same on every rank), the
page geometry and dtype, and the host pool layout, so pages from an
incompatible pool are never read.

Extra config keys besides SGLang's three: ``address``, ``timeout_s``,
``tenant``, ``model_id`` (default: SGLang's model name), and for a daemon
with ``auth: curve`` ``server_public_key`` and ``client_secret_key`` (Z85
text or key file paths; docs/security.md).  A daemon that is down
or slow is a miss (``get`` -> None, ``exists`` -> False, ``set`` -> False).
SGLang calls the backend from its prefetch and backup threads at once, so
each thread gets its own client.

Primitives: :class:`LMCacheServerHiCacheStorage` (``get``, ``batch_get``,
``set``, ``batch_set``, ``exists``, ``batch_exists``, ``clear``) and
:func:`page_key`.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import Any

from ..client import DEFAULT_ADDRESS, CacheClient
from ..curve import CurveKeys
from ..errors import ClientError
from ..namespace import Namespace, canonical_dtype
from ..tensors import tensor_bytes
from .transfer import ChunkTransfer

logger = logging.getLogger(__name__)

try:  # pragma: no cover - exercised only where SGLang is installed
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
except ImportError:

    class HiCacheStorage:  # type: ignore[no-redef]
        """Local stand-in for SGLang's abstract base when SGLang is absent."""


PAGE_KEY_DOMAIN = b"lmcache-sglang-page-v1"
_SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")
_OUR_KEYS = ("address", "timeout_s", "tenant", "model_id", "server_public_key", "client_secret_key")


def page_key(page_hash: str) -> bytes:
    """The daemon key of one SGLang page hash."""
    return hashlib.sha256(PAGE_KEY_DOMAIN + page_hash.encode()).digest()


class LMCacheServerHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """A ``HiCacheStorage`` whose pages live in the lmcache-server daemon."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None):
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        unknown = sorted(set(extra) - set(_SGLANG_KEYS) - set(_OUR_KEYS))
        if unknown:
            raise ValueError(f"unknown hicache storage extra config keys {unknown}; ours: {list(_OUR_KEYS)}")
        self.address = str(extra.get("address", DEFAULT_ADDRESS))
        self.timeout_s = float(extra.get("timeout_s", 2.0))
        self.tenant = str(extra.get("tenant", ""))
        self.server_public_key = str(extra.get("server_public_key") or "") or None
        self.client_secret_key = str(extra.get("client_secret_key") or "") or None
        # Refuse bad keys here, at start, not later in a prefetch thread.
        CurveKeys.from_options(self.server_public_key, self.client_secret_key)
        self.model_id = str(extra.get("model_id") or storage_config.model_name or "")
        if not self.model_id:
            raise ValueError("no model name: SGLang passes --model-path, or set model_id in the extra config")
        self.is_mla = bool(storage_config.is_mla_model)
        self.tp_rank = 0 if self.is_mla else int(storage_config.tp_rank)
        self.tp_size = 1 if self.is_mla else int(storage_config.tp_size)
        self.namespace: str | None = None
        self.mem_pool_host: Any = None
        self.page_bytes = 0
        self._local = threading.local()
        self._clients: list[CacheClient] = []
        self._lock = threading.Lock()

    # -- setup ---------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang's host KV pool: its page geometry completes the namespace."""
        self.mem_pool_host = mem_pool_host
        dummy = mem_pool_host.get_dummy_flat_data_page()
        self.page_bytes = dummy.numel() * dummy.element_size()
        if self.is_mla:
            heads, dim = 1, int(mem_pool_host.kv_cache_dim)
        else:
            heads, dim = int(mem_pool_host.head_num), int(mem_pool_host.head_dim)
        layout = f"sglang-{'mla-' if self.is_mla else ''}{mem_pool_host.layout}"
        self.namespace = Namespace(
            model=self.model_id,
            dtype=canonical_dtype(mem_pool_host.dtype),
            num_layers=int(mem_pool_host.layer_num),
            num_kv_heads=heads,
            head_dim=dim,
            chunk_size=int(mem_pool_host.page_size),
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            tenant=self.tenant,
            layout=layout,
        ).wire()
        logger.info("lmcache-server HiCache storage at %s, namespace %s", self.address, self.namespace)

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
            transfer = self._local.transfer = ChunkTransfer(client, self.namespace, self.page_bytes)
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
        return targets[:loaded] + [None] * (len(keys) - loaded)

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
        payloads = [tensor_bytes(v.detach().cpu()) for v in values]
        return self._transfer().put([page_key(k) for k in keys], payloads) == len(keys)

    def clear(self) -> bool:
        """Remove every page of this namespace (other models' and tenants' pages stay)."""
        transfer = self._transfer()
        try:
            removed = transfer.client.clear(namespace=transfer.namespace)
        except ClientError as err:
            logger.warning("lmcache clear failed (%s)", err)
            return False
        logger.info("cleared %d pages from lmcache-server", removed)
        return True
