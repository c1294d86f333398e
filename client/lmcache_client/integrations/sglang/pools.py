"""SGLang's hybrid host pools beyond KV (Mamba state, SWA KV) through its v2 storage calls.

A hybrid model's HiCache moves, beside each full-attention page, the pages of
side pools: ``mamba`` (the recurrent state at the end of a page, one slot per
page, ``MambaPoolHost``) and ``swa`` (the sliding-window layers' KV, a second
``MHATokenToKVPoolHost``).  SGLang names them with the KV page's hash, so each
side pool lives in a namespace of its own: the KV namespace with the pool's
name and geometry appended to its layout (``...+pool=mamba-L3-P1-B8960``),
and the Mamba state per TP rank even for MLA models (the state is sharded).
A side page is stored as the pool's flat data page (``get_data_page`` /
``set_from_flat_data_page``), opaque bytes of exactly the pool's page size.

``batch_exists_v2`` follows SGLang's hit policies: ``all_pages`` (every page
of the KV prefix present in the pool) and ``trailing_pages`` (the last
``len(transfer.keys)`` pages of a prefix, what Mamba and SWA need); the
usable prefixes are those every pool can restore.  Other policies
(``block_groups``) and pools (DSA indexer, DeepSeek V4 compressed caches,
draft sidecars) are refused when SGLang registers them.

Primitives: :data:`SIDE_POOLS`, :class:`SidePool`, :func:`restorable_prefixes`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import ClientError
from ...namespace import Namespace, canonical_dtype
from ..transfer import ChunkTransfer

logger = logging.getLogger(__name__)

SIDE_POOLS = ("mamba", "swa")
"""SGLang's ``PoolName`` values of the side pools stored beside KV."""
ALL_PAGES, TRAILING_PAGES = "all_pages", "trailing_pages"


@dataclasses.dataclass(frozen=True)
class SidePool:
    """One registered side pool: its host pool, its namespace and its page size in bytes."""

    name: str
    host_pool: Any
    namespace: Namespace
    page_bytes: int
    page_size: int
    page_dtype: Any
    """The dtype of the pool's flat pages (``set_from_flat_data_page`` takes its elements)."""

    @classmethod
    def register(cls, name: str, host_pool: Any, kv: Namespace, tp_rank: int, tp_size: int) -> SidePool:
        """The side pool ``name`` next to the KV namespace ``kv``; ``tp_rank``/``tp_size``:
        the engine's own (a Mamba state is per rank even where KV is shared)."""
        if name not in SIDE_POOLS:
            raise ValueError(
                f"lmcache-server HiCache storage stores only the KV, Mamba and SWA pools, not SGLang's "
                f"{name} pool ({type(host_pool).__name__}): DSA indexer, DeepSeek V4 and draft sidecars "
                "are not supported"
            )
        try:
            dummy = host_pool.get_dummy_flat_data_page()
            host_pool.get_data_page(0, flat=True)
        except (NotImplementedError, ValueError, AttributeError) as err:
            raise ValueError(
                f"lmcache-server HiCache storage needs SGLang's flat host pages, which the {name} pool "
                f"{type(host_pool).__name__} does not offer: {err}"
            ) from err
        page_bytes = int(dummy.numel() * dummy.element_size())
        page_size = int(host_pool.page_size)
        layers = int(host_pool.num_mamba_layers if name == "mamba" else host_pool.layer_num)
        tag = f"pool={name}-L{layers}-P{page_size}-B{page_bytes}"
        fields: dict[str, Any] = {"layout": f"{kv.layout}+{tag}" if kv.layout else tag}
        fields["dtype"] = canonical_dtype(host_pool.dtype)
        if name == "mamba":
            fields.update(tp_rank=tp_rank, tp_size=tp_size)
        namespace = dataclasses.replace(kv, **fields)
        logger.info("lmcache-server HiCache %s pool, namespace %s", name, namespace.wire())
        return cls(name, host_pool, namespace, page_bytes, page_size, dummy.dtype)

    def slots(self, keys: Sequence[str], host_indices: Any) -> list[int]:
        """The first host slot of each key's page."""
        if host_indices is None or host_indices.numel() != len(keys) * self.page_size:
            got = 0 if host_indices is None else host_indices.numel()
            raise ValueError(f"{self.name}: {len(keys)} pages need {len(keys) * self.page_size} host slots, got {got}")
        return [int(slot) for slot in host_indices[:: self.page_size].tolist()]

    def read(self, slot: int) -> Any:
        """The bytes of the page at ``slot`` (a flat uint8 tensor)."""
        import torch

        return self.host_pool.get_data_page(slot, flat=True).contiguous().view(-1).view(torch.uint8)

    def write(self, slot: int, view: memoryview) -> bool:
        """Put a stored page into the pool at ``slot``; False when it is not one page."""
        import torch

        if view.nbytes != self.page_bytes:
            logger.warning("%s page of %d bytes, pages are %d: not loaded", self.name, view.nbytes, self.page_bytes)
            return False
        data = torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8).view(self.page_dtype)
        self.host_pool.set_from_flat_data_page(slot, data)
        return True


def restorable_prefixes(present: Sequence[bool], policy: str, trailing: int, kv_pages: int) -> set[int]:
    """The prefix lengths (in pages, 1..kv_pages) a pool can restore, given which of the
    first ``kv_pages`` pages it holds; ``trailing``: pages a prefix needs at its end."""
    if policy == ALL_PAGES:
        boundary = next((i for i in range(kv_pages) if not present[i]), kv_pages)
        return set(range(1, boundary + 1))
    if policy == TRAILING_PAGES:
        need = max(1, trailing)
        return {p for p in range(1, kv_pages + 1) if all(present[max(0, p - need) : p])}
    raise ValueError(f"hit policy {policy!r} is not supported by lmcache-server HiCache storage")


class SidePools:
    """The registered side pools and the v2 calls on them, over the calling thread's client.

    Reads and writes go through :class:`~..transfer.ChunkTransfer` (batches the daemon
    accepts, whole pages of the pool's size only, a failure is a miss); SGLang counts
    the leading pages of each pool, so a transfer stops at the first page missing."""

    def __init__(self, key_of: Callable[[str], bytes]):
        self.pools: dict[str, SidePool] = {}
        self._key = key_of  # SGLang page hash -> daemon key, the KV pages' rule
        self._local = threading.local()

    def add(self, pool: SidePool) -> None:
        self.pools[pool.name] = pool

    def _pool(self, name: str) -> SidePool:
        if name not in self.pools:
            raise ValueError(f"SGLang's {name} pool was not registered with lmcache-server HiCache storage")
        return self.pools[name]

    def _transfer(self, client: Any, pool: SidePool) -> ChunkTransfer:
        made: dict[tuple[int, str], ChunkTransfer] = self._local.__dict__.setdefault("transfers", {})
        key = (id(client), pool.name)
        if key not in made:
            made[key] = ChunkTransfer(client, pool.namespace, pool.page_bytes)
        return made[key]

    def exists(self, client: Any, keys: Sequence[str], kv_pages: int, transfers: Sequence[Any]) -> Any:
        """``batch_exists_v2``'s answer given the leading KV hits (SGLang's ``PoolTransferResult``)."""
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        hits: dict[str, int] = {"kv": kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in transfers:
            if not restorable:
                break
            pool = self._pool(str(transfer.name))
            try:
                present = client.exists([self._key(k) for k in keys[:kv_pages]], namespace=pool.namespace)
            except ClientError as err:  # a daemon that fails is a miss
                logger.warning("lmcache exists in the %s pool failed (%s)", pool.name, err)
                present = [False] * kv_pages
            policy = str(getattr(transfer.hit_policy, "value", transfer.hit_policy))
            ok = restorable_prefixes(present, policy, len(transfer.keys or ()), kv_pages)
            if ok:
                hits[pool.name] = max(ok)
            restorable &= ok
        return PoolTransferResult(max(restorable, default=0), hits, sorted(restorable))

    def get(self, client: Any, transfer: Any) -> list[bool]:
        """Load one transfer's pages into its host pool; True for the leading pages loaded."""
        pool = self._pool(str(transfer.name))
        keys = list(transfer.keys or ())
        slots = pool.slots(keys, transfer.host_indices)
        if not keys:
            return []

        def use(i: int, view: memoryview) -> None:
            pool.write(slots[i], view)

        loaded = self._transfer(client, pool).get_prefix_with([self._key(k) for k in keys], use)
        return [True] * loaded + [False] * (len(keys) - loaded)

    def set(self, client: Any, transfer: Any) -> list[bool]:
        """Store one transfer's pages from its host pool; True per page stored (now or before)."""
        pool = self._pool(str(transfer.name))
        keys = list(transfer.keys or ())
        slots = pool.slots(keys, transfer.host_indices)
        if not keys:
            return []

        def fill(i: int, view: memoryview) -> None:
            import torch

            torch.frombuffer(view, dtype=torch.uint8).copy_(pool.read(slots[i]))

        stored = self._transfer(client, pool).put_with([self._key(k) for k in keys], fill)
        return [True] * stored + [False] * (len(keys) - stored)
