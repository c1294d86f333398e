"""The memory tier's index: its state, the entries of stored chunks, their leases,
removal, and the byte accounts (one layer of :class:`.tier.MemoryTier`).

- ``_index`` maps each key to its entry: a packed int while the chunk is neither
  leased nor pinned, an :class:`.entry.Entry` object while something needs one
  (:meth:`ChunkIndex._entry` unpacks, :meth:`ChunkIndex._pack` packs again).
- A lease (:meth:`ChunkIndex._lease`) hands out a :class:`Chunk` view of the pool;
  its release frees the extent of a chunk removed meanwhile (``dead``), so bytes
  are never overwritten under a reader.
- :meth:`ChunkIndex._remove` takes a chunk out of the index, the policy and the
  accounts; :meth:`ChunkIndex._account` keeps ``stored_bytes``, the tenants' and
  the namespaces' counts.
- What a chunk is charged, in its tenant's quota and in the pinned bytes, is its
  *extent* (``extent_of(size)``: the payload rounded up to 4 KiB pages), the
  bytes it holds in the pool: charged payload bytes, one-byte chunks would hold
  4096 times a quota or the pin limit.  ``stored_bytes`` and the namespaces'
  byte counts stay payload bytes (what was stored).
- Pins have two bounds (:meth:`ChunkIndex.pin_room`): all pinned extents
  together at most ``max_pinned_bytes`` (``max_pinned_fraction`` of the pool),
  and each tenant with a memory quota at most its *share*, the same fraction
  of its quota, so that one tenant cannot take the pinnable room and keeps
  part of its quota for chunks that come and go.

Every attribute of the tier is set here, in :meth:`ChunkIndex.__init__` (the
tier's constructor); :mod:`.eviction` and :mod:`.tier` build on this class.

Primitives: :class:`ChunkIndex` (``_entry``, ``_pack``, ``_lease``, ``_release``,
``_remove``, ``_account``, ``_account_pin``, ``pin_room``, ``_touch``,
``_is_leased``), :class:`PinRoom`, :class:`TierCounters`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from ..base import Chunk, ChunkKey
from ..policy import EvictionPolicy, LRUPolicy
from ..tenants import TenantQuotas
from .allocator import ExtentAllocator, extent_of
from .entry import Entry as _Entry
from .entry import Reservation, pack, packable, unpack
from .entry import shared as _shared
from .pool import MemoryPool


@dataclasses.dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    stores: int = 0
    rejections: int = 0
    skipped: int = 0
    adopted: int = 0  # chunks taken over from the daemon before a warm restart
    replaced_wrong_size: int = 0  # stored chunks replaced by a put of another size


@dataclasses.dataclass(frozen=True)
class PinRoom:
    """How many more bytes (extents) a namespace's chunks may pin, and the bound that says so."""

    left: int
    limit: int
    tenant: str | None
    """The tenant whose share is the tighter bound; None: the pool-wide ``max_pinned_bytes``."""


class ChunkIndex:
    """The state of a memory tier and the bookkeeping of its entries (see the module)."""

    name: str

    def __init__(
        self,
        pool: MemoryPool,
        max_pinned_bytes: int,
        policy: EvictionPolicy | None = None,
        on_evict: Callable[[ChunkKey, Chunk, bool], bool] | None = None,
    ):
        self.pool = pool
        self.allocator = ExtentAllocator(pool.size, track_sizes=False)  # the entries keep the sizes
        self.max_pinned_bytes = max_pinned_bytes
        self.policy = policy if policy is not None else LRUPolicy()
        self.on_evict = on_evict
        self.on_removed: Callable[[ChunkKey], None] | None = None
        """Called after a chunk leaves the index (evicted, deleted, cleared); set by the tiered store."""
        self.spill_ahead_bytes = 0  # set by the tiered store when a disk tier takes spills
        self.lends_spills = False  # set by the tiered store when a disk tier takes spills
        self.dying_bytes = 0  # extents of removed chunks still leased (being sent or spilled)
        self.lent_bytes = 0  # of which lent to the spill: back once the disk has them
        self._room: asyncio.Event | None = None  # set when a dying extent is freed
        self.counters = TierCounters()
        self.quotas = TenantQuotas()
        """Per-tenant byte limits (``tenant_quotas``); set by the composition root."""
        self._index: dict[ChunkKey, int | _Entry] = {}
        # Keys with a store under way (prepare_store until complete_store or
        # abort_store): the first reservation of a key claims it, so a second
        # writer is EXISTS at once, whichever path (frames, alloc, staged bind)
        # each takes, and never told STORED for a copy that would lose later.
        self._claims: dict[ChunkKey, Reservation] = {}
        """key -> its entry: a packed int while neither leased nor pinned (storage/memory/entry.py)."""
        self._by_namespace: dict[str, list[int]] = {}  # ns -> [chunks, bytes]
        self.stored_bytes = 0
        self.pinned_bytes = 0  # extents of pinned chunks
        self._pinned_by_namespace: dict[str, list[int]] = {}  # ns -> [pinned chunks, their extents]
        self.leased_chunks = 0
        self.evictable_bytes = 0  # extents of indexed chunks neither leased nor pinned
        self.keep_segment = False  # leave the shared segment at close: its index was written

    def _touch(self, key: ChunkKey, found: int | _Entry) -> None:
        """Tell the policy of a hit on ``found`` (``key``'s entry) unless it is pinned."""
        if isinstance(found, int):
            self.policy.touched(key)
        elif not found.pinned:
            self.policy.touched(found.key)  # the tier's key object: a policy keeping it adds no copy

    def _entry(self, key: ChunkKey, found: int | _Entry | None = None) -> _Entry:
        """``key``'s entry as an object (kept in the index until :meth:`_pack` packs it
        again); ``found``: ``self._index[key]`` when the caller has it."""
        if found is None:
            found = self._index[key]
        if not isinstance(found, int):
            return found
        offset, size = unpack(found)
        entry = self._index[key] = _Entry(key, offset, _shared(size), _shared(extent_of(size)))
        return entry

    def _pack(self, entry: _Entry) -> None:
        """Store an indexed entry as one int again once nothing needs its object."""
        if not (entry.leases or entry.pinned or entry.dead) and packable(entry.offset, entry.size):
            self._index[entry.key] = pack(entry.offset, entry.size)

    def _lease(self, entry: _Entry) -> Chunk:
        entry.leases += 1
        if entry.leases == 1:
            self.leased_chunks += 1
            if not entry.pinned and not entry.dead:
                self.evictable_bytes -= entry.extent
        view = self.pool.view[entry.offset : entry.offset + entry.size]
        return Chunk(view, self.name, lambda: self._release(entry), entry.offset)

    def _release(self, entry: _Entry) -> None:
        entry.leases -= 1
        if entry.leases == 0:
            self.leased_chunks -= 1
            if entry.dead:
                self.dying_bytes -= entry.extent
                if entry.lent:
                    self.lent_bytes -= entry.extent
                self.allocator.free(entry.offset, entry.extent)
                if self._room is not None:
                    self._room.set()
            elif not entry.pinned:
                self.evictable_bytes += entry.extent
                self._pack(entry)

    def _is_leased(self, key: ChunkKey) -> bool:
        found = self._index[key]
        return not isinstance(found, int) and found.leases > 0

    def _remove(self, entry: _Entry) -> None:
        del self._index[entry.key]
        if entry.pinned:
            self._account_pin(entry.key, entry.extent, -1)
        else:
            self.policy.removed(entry.key)
            if not entry.leases:
                self.evictable_bytes -= entry.extent
        self._account(entry.key, entry.size, -1)
        if entry.leases:
            entry.dead = True
            self.dying_bytes += entry.extent
        else:
            self.allocator.free(entry.offset, entry.extent)
        if self.on_removed is not None:
            self.on_removed(entry.key)

    def _account_pin(self, key: ChunkKey, extent: int, sign: int) -> None:
        """A pin (+1) or its end (-1, unpinned or removed) of a chunk holding
        ``extent`` bytes of the pool, in ``pinned_bytes``, per namespace and per tenant."""
        self.pinned_bytes += sign * extent
        self.quotas.account_pinned(key.namespace, sign * extent)
        counts = self._pinned_by_namespace.setdefault(key.namespace, [0, 0])
        counts[0] += sign
        counts[1] += sign * extent
        if not counts[0]:
            del self._pinned_by_namespace[key.namespace]

    def pinned_in(self, namespace: str) -> tuple[int, int]:
        """The pinned chunks of ``namespace`` and the bytes they hold in the pool (extents)."""
        counts = self._pinned_by_namespace.get(namespace, (0, 0))
        return counts[0], counts[1]

    def pin_room(self, namespace: str) -> PinRoom:
        """The room left to pin chunks of ``namespace``: the tighter of the pool-wide
        ``max_pinned_bytes`` and, for a tenant with a quota here, its share (see the module)."""
        room = PinRoom(self.max_pinned_bytes - self.pinned_bytes, self.max_pinned_bytes, None)
        found = self.quotas.limit_for(namespace)
        if found is not None:
            tenant, quota = found
            share = min(quota * self.max_pinned_bytes // self.pool.size, self.max_pinned_bytes)
            left = share - self.quotas.pinned(tenant)
            if left < room.left:
                room = PinRoom(left, share, tenant)
        return room

    def _account(self, key: ChunkKey, size: int, sign: int) -> None:
        """A chunk of ``size`` payload bytes stored (+1) or removed (-1): payload bytes
        in ``stored_bytes`` and the namespace's count, its extent in its tenant's."""
        self.stored_bytes += sign * size
        self.quotas.account(key.namespace, sign * extent_of(size))
        counts = self._by_namespace.setdefault(key.namespace, [0, 0])
        counts[0] += sign
        counts[1] += sign * size
        if counts[0] == 0:
            del self._by_namespace[key.namespace]
