"""The memory tier: chunks in the fixed pool, LRU eviction, leases and pins.

- Space comes from :class:`ExtentAllocator` over :class:`MemoryPool`; a put that
  does not fit evicts least-recently-used chunks until it does, or answers
  NO_SPACE when only pinned or leased chunks are left.
- Which chunk leaves is the policy's choice (:mod:`.policy`; LRU by default);
  the tier tells it about inserts, hits and removals and asks it for victims.
- A chunk handed out by :meth:`get` is *leased* until its :class:`Chunk` is
  released (the server releases it once ZeroMQ has finished sending it).
  Eviction skips leased chunks; deleting one hides it at once and frees its
  bytes when the last lease ends, so bytes are never overwritten under a reader.
- Pinned chunks are taken out of the policy altogether (never evicted) and
  may fill at most ``max_pinned_bytes``.
- ``on_evict(key, chunk, lend)`` is called with a leased :class:`Chunk` of each
  evicted entry, so the tiered store can spill it to a lower tier.  When a put
  is waiting for the room (``lend`` False) the receiver copies what it needs
  and the lease ends on return.  With ``spill_ahead_bytes`` set, the tier also
  evicts *ahead*, after an allocation, until that many bytes are free or on
  their way out; those chunks are *lent* (``lend`` True): the receiver may keep
  the lease, e.g. to write the bytes to disk straight from the pool, and the
  extent is reused only after it releases it.  ``on_evict`` returning False
  declines a lent chunk, which then stays stored.

Accounting is exact: ``stored_bytes`` counts payload bytes, ``allocated_bytes``
what the allocator handed out (payload rounded up to 4 KiB pages), and
``evictable_bytes`` the extents of stored chunks neither leased nor pinned, kept
up to date on every change so that a put under pressure asks in O(1) whether
evicting could make room at all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from lmcache_client.protocol import PutStatus

from ..base import Chunk, ChunkKey
from ..policy import EvictionPolicy, LRUPolicy
from ..tenants import TenantQuotas, tenant_of
from . import warm
from .allocator import ExtentAllocator, aligned, extent_of
from .entry import UNBOUND, Reservation, pack, packable, unpack
from .entry import Entry as _Entry
from .entry import canonical as _canonical
from .entry import shared as _shared
from .pool import MemoryPool

logger = logging.getLogger(__name__)


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


class MemoryTier:
    name = "memory"

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
        self.pinned_bytes = 0
        self.leased_chunks = 0
        self.evictable_bytes = 0  # extents of indexed chunks neither leased nor pinned
        self.keep_segment = False  # leave the shared segment at close: its index was written

    # -- reads ---------------------------------------------------------------------
    async def get(self, key: ChunkKey) -> Chunk | None:
        found = self._index.get(key)
        if found is None:
            self.counters.misses += 1
            return None
        self.counters.hits += 1
        self._touch(key, found)
        return self._lease(self._entry(key, found))

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

    async def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [k in self._index for k in keys]

    def peek(self, key: ChunkKey) -> bool:
        """Whether ``key`` is stored, without touching recency or counters."""
        return key in self._index

    def peek_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        index = self._index
        return [key in index for key in keys]

    # -- writes --------------------------------------------------------------------
    async def put(self, key: ChunkKey, data: Any, parent: ChunkKey | None = None) -> PutStatus:
        """Store ``data`` under ``key``; ``parent`` is the chunk before it in its
        prefix chain when known (a hint for the policy)."""
        src = memoryview(data).cast("B")
        reservation = self.prepare_store(key, src.nbytes, parent)
        if not isinstance(reservation, Reservation):
            return reservation
        # Copy first, index after: a chunk is visible only once complete.
        reservation.view[:] = src
        return self.complete_store(reservation)

    def prepare_store(self, key: ChunkKey, size: int, parent: ChunkKey | None = None) -> Reservation | PutStatus:
        """Phase one of a store: room for ``size`` bytes, invisible to readers.

        Returns a Reservation to fill and then :meth:`complete_store` or
        :meth:`abort_store`, or the PutStatus explaining why there is none.
        """
        refused = self._refusal(key, size, parent)
        if refused is not None:
            return refused
        key = _canonical(key)
        offset = self._allocate(size)
        if offset is not None and not self.pool.commit(offset, size):
            self.allocator.free(offset, size)  # the shared-memory filesystem is full
            offset = None
        if offset is None:
            if not self.room_coming(size):  # else the caller may wait for it (and counts it if not)
                self.counters.rejections += 1
            return PutStatus.NO_SPACE
        reservation = Reservation(key, offset, size, parent, self.pool.view[offset : offset + size])
        self._claims[key] = reservation
        return reservation

    def _unclaim(self, reservation: Reservation) -> None:
        if self._claims.get(reservation.key) is reservation:
            del self._claims[reservation.key]

    def _refusal(self, key: ChunkKey, size: int, parent: ChunkKey | None) -> PutStatus | None:
        """Why ``key`` may not be stored (EXISTS, TOO_LARGE, SKIPPED, NO_SPACE over
        its tenant's quota), else None: the checks of a store before it takes room."""
        existing = self._index.get(key)
        if existing is not None and not self._replaced_wrong_size(key, existing, size):
            self._touch(key, existing)
            return PutStatus.EXISTS
        if key in self._claims:
            return PutStatus.EXISTS  # another writer's store of it is under way: first writer wins
        key = _canonical(key)
        if size > self.allocator.capacity:
            self.counters.rejections += 1
            return PutStatus.TOO_LARGE
        if not self.policy.admit(key, size, parent):
            self.counters.skipped += 1
            return PutStatus.SKIPPED
        if self.quotas and not self._within_quota(key, size):
            self.counters.rejections += 1
            return PutStatus.NO_SPACE
        return None

    def _replaced_wrong_size(self, key: ChunkKey, found: int | _Entry, size: int) -> bool:
        """A stored chunk whose size differs from a new put's (another layout under
        a colliding namespace, a partial write committed) would be EXISTS for ever
        and a miss on every load: remove it (counted, logged) so the put stores
        the new one, once it has no readers and is not pinned (else EXISTS now)."""
        entry_size = unpack(found)[1] if isinstance(found, int) else found.size
        if entry_size == size or (not isinstance(found, int) and (found.leases or found.pinned)):
            return False
        self._remove(self._entry(key, found))
        self.counters.replaced_wrong_size += 1
        logger.warning("chunk %s/%s stored with %d bytes replaced by a put of %d bytes",
                       key.namespace, key.digest.hex()[:16], entry_size, size)  # fmt: skip
        return True

    def room_coming(self, size: int) -> bool:
        """Whether chunks lent to the spill will free room for ``size`` bytes once written."""
        return bool(self.lent_bytes) and self.allocator.free_bytes + self.lent_bytes >= aligned(size)

    async def wait_for_room(self, timeout_s: float) -> bool:
        """Wait until an extent of a removed chunk is freed (False: ``timeout_s`` passed first)."""
        if self._room is None:
            self._room = asyncio.Event()
        self._room.clear()
        try:
            await asyncio.wait_for(self._room.wait(), max(timeout_s, 0.0))
        except TimeoutError:
            return False
        return True

    def complete_store(self, reservation: Reservation) -> PutStatus:
        """Phase two: make a filled reservation visible (EXISTS if the key was stored meanwhile)."""
        r = reservation
        self._unclaim(r)
        if r.key in self._index:
            self.allocator.free(r.offset, r.size)
            return PutStatus.EXISTS
        key = _canonical(r.key)
        self._index[key] = pack(r.offset, r.size) if packable(r.offset, r.size) else _Entry(
            key, r.offset, r.size, extent_of(r.size))  # fmt: skip
        self.evictable_bytes += extent_of(r.size)
        self.policy.inserted(key, r.size, r.parent)
        self._account(key, r.size, +1)
        self.counters.stores += 1
        return PutStatus.STORED

    def abort_store(self, reservation: Reservation) -> None:
        self._unclaim(reservation)
        self.allocator.free(reservation.offset, reservation.size)

    def reserve_room(self, size: int) -> Reservation | None:
        """Room for ``size`` bytes bound to no key yet (key :data:`UNBOUND`: a staged
        shared-memory slot), evicting as a store would; None when there is none.
        Give it back with :meth:`abort_store`, or :meth:`bind_room` it."""
        if size > self.allocator.capacity:
            return None
        offset = self._allocate(size)
        if offset is not None and not self.pool.commit(offset, size):
            self.allocator.free(offset, size)
            offset = None
        if offset is None:
            return None
        return Reservation(UNBOUND, offset, size, None, self.pool.view[offset : offset + size])

    def bind_room(self, room: Reservation, key: ChunkKey, parent: ChunkKey | None = None) -> Reservation | PutStatus:
        """:meth:`prepare_store` for ``key`` over ``room`` (from :meth:`reserve_room`):
        the same checks, then a Reservation of that room to :meth:`complete_store`;
        or the PutStatus saying why not (``room`` stays reserved, unbound)."""
        refused = self._refusal(key, room.size, parent)
        if refused is not None:
            return refused
        return Reservation(_canonical(key), room.offset, room.size, parent, room.view)

    def lease(self, key: ChunkKey) -> Chunk | None:
        """A leased view of a stored chunk without counting a hit or touching recency."""
        found = self._index.get(key)
        if found is None:
            return None
        return self._lease(self._entry(key, found))

    def _allocate(self, size: int) -> int | None:
        offset = self.allocator.alloc(size)
        if offset is None:
            offset = self._evict_for(size)
        if offset is not None and self.spill_ahead_bytes:
            self._evict_ahead()
        return offset

    def _evict_for(self, size: int) -> int | None:
        """Evict the policy's victims until the allocation fits; chunks being read
        (leased) are never victims.  With a disk tier the victims are lent to it
        (written straight from the pool: copying 32 MiB here would stall the
        event loop), so their room comes back only once written: None then, and
        :meth:`room_coming` says the caller may wait for it."""
        if (self.pinned_bytes or self.leased_chunks) and not self._could_fit(size):
            return None  # refuse without evicting chunks for nothing
        while not self.room_coming(size) and (key := self.policy.victim(self._is_leased)) is not None:
            self._evict_lending(self._entry(key))
            offset = self.allocator.alloc(size)
            if offset is not None:
                return offset
        return None

    def _evict_lending(self, entry: _Entry) -> None:
        """Evict ``entry``, lent to the spill when a disk tier takes it, else at once."""
        if not (self.lends_spills and self._evict(entry, lend=True)):
            # A spill declined (queue full): dropped, no copy.  Its lease ended, so the
            # index may hold the entry packed again: evict the index's entry, not a stale copy.
            self._evict(self._entry(entry.key), lend=False)

    def _evict_ahead(self) -> None:
        """Lend victims to the spill until ``spill_ahead_bytes`` (at most an eighth
        of the pool) are free or on their way out, so that the next puts find
        room without waiting for a copy."""
        target = min(self.spill_ahead_bytes, self.allocator.capacity // 8)
        while self.allocator.free_bytes + self.dying_bytes < target:
            key = self.policy.victim(self._is_leased)
            if key is None or not self._evict(self._entry(key), lend=True):
                return

    def _evict(self, entry: _Entry, lend: bool) -> bool:
        """Evict ``entry`` (False: the receiver declined a lent chunk; it stays)."""
        if self.on_evict is not None:
            chunk = self._lease(entry)
            taken = self.on_evict(entry.key, chunk, lend)
            if not lend:
                chunk.release()
            elif not taken:
                chunk.release()
                return False
            elif entry.leases:  # still lent: its extent is freed when the spill is written
                entry.lent = True
                self.lent_bytes += entry.extent
        self._remove(entry)
        self.counters.evictions += 1
        self.counters.evicted_bytes += entry.size
        return True

    def _is_leased(self, key: ChunkKey) -> bool:
        found = self._index[key]
        return not isinstance(found, int) and found.leases > 0

    def _within_quota(self, key: ChunkKey, size: int) -> bool:
        """Evict the key's tenant's own chunks until ``size`` more bytes fit its
        quota (storage/tenants.py); False when they cannot."""
        found = self.quotas.limit_for(key.namespace)
        if found is None:
            return True
        tenant, limit = found
        if size > limit:
            return False

        def not_theirs(k: ChunkKey) -> bool:
            return self._is_leased(k) or tenant_of(k.namespace) != tenant

        while self.quotas.used(tenant) + size > limit:
            victim = self.policy.victim(not_theirs)
            if victim is None:
                return False
            self._evict_lending(self._entry(victim))
            self.quotas.evictions[tenant] += 1
        return True

    def _could_fit(self, size: int) -> bool:
        """Whether evicting every evictable chunk would free enough bytes (O(1):
        ``evictable_bytes`` is kept current; asked when pinned or leased chunks
        make the answer uncertain)."""
        return self.allocator.free_bytes + self.evictable_bytes >= aligned(size)

    async def delete(self, key: ChunkKey) -> bool:
        found = self._index.get(key)
        if found is None:
            return False
        self._remove(self._entry(key, found))
        return True

    async def clear(self, namespace: str | None) -> int:
        victims = [k for k in self._index if namespace is None or k.namespace == namespace]
        for key in victims:
            self._remove(self._entry(key))
        return len(victims)

    def _remove(self, entry: _Entry) -> None:
        del self._index[entry.key]
        if entry.pinned:
            self.pinned_bytes -= entry.size
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

    def _account(self, key: ChunkKey, size: int, sign: int) -> None:
        self.stored_bytes += sign * size
        self.quotas.account(key.namespace, sign * size)
        counts = self._by_namespace.setdefault(key.namespace, [0, 0])
        counts[0] += sign
        counts[1] += sign * size
        if counts[0] == 0:
            del self._by_namespace[key.namespace]

    # -- pins ----------------------------------------------------------------------
    def pin(self, key: ChunkKey) -> bool:
        found = self._index.get(key)
        if found is None:
            return False
        if not isinstance(found, int) and found.pinned:
            return True
        size = unpack(found)[1] if isinstance(found, int) else found.size
        if self.pinned_bytes + size > self.max_pinned_bytes:
            return False
        entry = self._entry(key, found)
        entry.pinned = True
        self.pinned_bytes += entry.size
        if not entry.leases:
            self.evictable_bytes -= entry.extent
        self.policy.removed(key)
        return True

    def unpin(self, key: ChunkKey) -> bool:
        entry = self._index.get(key)
        if entry is None or isinstance(entry, int) or not entry.pinned:
            return False
        entry.pinned = False
        self.pinned_bytes -= entry.size
        if not entry.leases:
            self.evictable_bytes += entry.extent
        self.policy.inserted(entry.key, entry.size, None)
        self._pack(entry)
        return True

    # -- warm restarts (storage/memory/warmstart.py; the work is in storage/memory/warm.py) --
    def snapshot(self) -> list[tuple[ChunkKey, int, int, bool]]:
        """Every stored chunk as ``(key, offset, size, pinned)``, next victim first
        (pinned chunks last): what the next daemon needs to adopt the pool."""
        return warm.snapshot(self)

    def adopt(self, chunks: Sequence[tuple[ChunkKey, int, int, bool]], held: Sequence[tuple[int, int]]) -> None:
        """Take over a pool left by a clean stop (see :func:`.warm.adopt`)."""
        warm.adopt(self, chunks, held)

    def held_chunk(self, offset: int, size: int) -> Chunk:
        """A leased view of a held extent of a read lease whose chunk is gone
        (deleted or evicted before the restart), freed when the lease ends."""
        return warm.held_chunk(self, offset, size)

    # -- introspection -------------------------------------------------------------
    @property
    def chunks(self) -> int:
        return len(self._index)

    def keys(self) -> list[ChunkKey]:
        return list(self._index)

    def namespaces(self) -> dict[str, tuple[int, int]]:
        return {ns: (c[0], c[1]) for ns, c in self._by_namespace.items()}

    def stats(self) -> dict[str, Any]:
        a = self.allocator
        return {
            "capacity_bytes": a.capacity,
            "stored_bytes": self.stored_bytes,
            "allocated_bytes": a.allocated_bytes,
            "free_bytes": a.free_bytes,
            "largest_free_bytes": a.largest_free,
            "free_extents": a.free_extents,
            "fragmentation": round(a.fragmentation, 4),
            "chunks": self.chunks,
            "pinned_bytes": self.pinned_bytes,
            "leased_chunks": self.leased_chunks,
            "evictable_bytes": self.evictable_bytes,
            "page_locked": self.pool.pinned,
            "policy": self.policy.name,
            **(self.policy.stats() if hasattr(self.policy, "stats") else {}),
            **({"tenants": self.quotas.stats()} if self.quotas else {}),
            **dataclasses.asdict(self.counters),
        }

    async def close(self) -> None:
        self._index.clear()
        self.evictable_bytes = 0
        self.pool.close(keep_segment=self.keep_segment)
