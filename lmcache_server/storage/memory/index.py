"""The memory tier's index: its state, the entries of stored chunks, their leases,
removal, and the byte accounts (a part :class:`.tier.MemoryTier` builds and holds).

- ``entries`` maps each key to its entry: a packed int while the chunk is neither
  leased nor pinned, an :class:`.entry.Entry` object while something needs one
  (:meth:`ChunkIndex.entry` unpacks, :meth:`ChunkIndex.repack` packs again).
- A lease (:meth:`ChunkIndex.lease_entry`) hands out a :class:`Chunk` view of the pool;
  its release frees the extent of a chunk removed meanwhile (``dead``), so bytes
  are never overwritten under a reader.
- :meth:`ChunkIndex.remove` takes a chunk out of the index, the policy and the
  accounts; :meth:`ChunkIndex.account` keeps ``stored_bytes``, the tenants' and
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

The state the tier's parts share is here, in :meth:`ChunkIndex.__init__`;
:class:`.eviction.TierEviction` and :class:`.tier.MemoryTier` hold the index.

Primitives: :class:`ChunkIndex` (``entry``, ``repack``, ``lease_entry``, ``release``,
``remove``, ``account``, ``account_pin``, ``pin_room``, ``touch``,
``is_leased``), :class:`PinRoom`, :class:`TierCounters`.
"""

from __future__ import annotations

import asyncio
import dataclasses

from ..base import Chunk, ChunkKey, TierLinks
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
    """The state of a memory tier and the bookkeeping of its entries (see the module);
    the chunks it leases are named ``name`` (the tier's)."""

    def __init__(
        self,
        name: str,
        pool: MemoryPool,
        max_pinned_bytes: int,
        policy: EvictionPolicy | None = None,
        *,
        links: TierLinks | None = None,
        quotas: TenantQuotas | None = None,
    ):
        self.name = name
        self.pool = pool
        self.allocator = ExtentAllocator(pool.size, track_sizes=False)  # the entries keep the sizes
        self.max_pinned_bytes = max_pinned_bytes
        self.policy = policy if policy is not None else LRUPolicy()
        self.links = links if links is not None else TierLinks()
        """The store that holds the tier is told of victims and removals on it (:class:`..base.TierLinks`)."""
        self.spill_ahead_bytes = self.links.spill_ahead_bytes or 0  # how far ahead victims are lent
        self.lends_spills = self.links.spill_ahead_bytes is not None  # a disk tier takes the spills
        self.dying_bytes = 0  # extents of removed chunks still leased (being sent or spilled)
        self.lent_bytes = 0  # of which lent to the spill: back once the disk has them
        self.room = asyncio.Event()  # set when a dying extent is freed
        self.counters = TierCounters()
        self.quotas = quotas if quotas is not None else TenantQuotas()
        """Per-tenant byte limits (``tenant_quotas``)."""
        self.entries: dict[ChunkKey, int | _Entry] = {}
        # Keys with a store under way (reserve until commit or
        # abort): the first reservation of a key claims it, so a second
        # writer is EXISTS at once, whichever path (frames, alloc, staged bind)
        # each takes, and never told STORED for a copy that would lose later.
        self.claims: dict[ChunkKey, Reservation] = {}
        """key -> its entry: a packed int while neither leased nor pinned (storage/memory/entry.py)."""
        self.by_namespace: dict[str, list[int]] = {}  # ns -> [chunks, bytes]
        self.stored_bytes = 0
        self.pinned_bytes = 0  # extents of pinned chunks
        self._pinned_by_namespace: dict[str, list[int]] = {}  # ns -> [pinned chunks, their extents]
        self.leased_chunks = 0
        self.evictable_bytes = 0  # extents of indexed chunks neither leased nor pinned

    def touch(self, key: ChunkKey, found: int | _Entry) -> None:
        """Tell the policy of a hit on ``found`` (``key``'s entry) unless it is pinned."""
        if isinstance(found, int):
            self.policy.touched(key)
        elif not found.pinned:
            self.policy.touched(found.key)  # the tier's key object: a policy keeping it adds no copy

    def entry(self, key: ChunkKey, found: int | _Entry | None = None) -> _Entry:
        """``key``'s entry as an object (kept in the index until :meth:`_pack` packs it
        again); ``found``: ``self.entries[key]`` when the caller has it."""
        if found is None:
            found = self.entries[key]
        if not isinstance(found, int):
            return found
        offset, size = unpack(found)
        entry = self.entries[key] = _Entry(key, offset, _shared(size), _shared(extent_of(size)))
        return entry

    def repack(self, entry: _Entry) -> None:
        """Store an indexed entry as one int again once nothing needs its object."""
        if not (entry.leases or entry.pinned or entry.dead) and packable(entry.offset, entry.size):
            self.entries[entry.key] = pack(entry.offset, entry.size)

    def lease_entry(self, entry: _Entry) -> Chunk:
        entry.leases += 1
        if entry.leases == 1:
            self.leased_chunks += 1
            if not entry.pinned and not entry.dead:
                self.evictable_bytes -= entry.extent
        view = self.pool.view[entry.offset : entry.offset + entry.size]
        return Chunk(view, self.name, lambda: self.release(entry), entry.offset)

    def release(self, entry: _Entry) -> None:
        entry.leases -= 1
        if entry.leases == 0:
            self.leased_chunks -= 1
            if entry.dead:
                self.dying_bytes -= entry.extent
                if entry.lent:
                    self.lent_bytes -= entry.extent
                self.allocator.free(entry.offset, entry.extent)
                self.room.set()
            elif not entry.pinned:
                self.evictable_bytes += entry.extent
                self.repack(entry)

    def is_leased(self, key: ChunkKey) -> bool:
        found = self.entries[key]
        return not isinstance(found, int) and found.leases > 0

    def remove(self, entry: _Entry) -> None:
        del self.entries[entry.key]
        if entry.pinned:
            self.account_pin(entry.key, entry.extent, -1)
        else:
            self.policy.removed(entry.key)
            if not entry.leases:
                self.evictable_bytes -= entry.extent
        self.account(entry.key, entry.size, -1)
        if entry.leases:
            entry.dead = True
            self.dying_bytes += entry.extent
        else:
            self.allocator.free(entry.offset, entry.extent)
        listener = self.links.listener
        if listener is not None:
            listener.left_memory(entry.key)

    def account_pin(self, key: ChunkKey, extent: int, sign: int) -> None:
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

    def account(self, key: ChunkKey, size: int, sign: int) -> None:
        """A chunk of ``size`` payload bytes stored (+1) or removed (-1): payload bytes
        in ``stored_bytes`` and the namespace's count, its extent in its tenant's."""
        self.stored_bytes += sign * size
        self.quotas.account(key.namespace, sign * extent_of(size))
        counts = self.by_namespace.setdefault(key.namespace, [0, 0])
        counts[0] += sign
        counts[1] += sign * size
        if counts[0] == 0:
            del self.by_namespace[key.namespace]
