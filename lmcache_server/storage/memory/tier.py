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
  may fill at most ``max_pinned_bytes`` of the pool, each tenant with a quota
  at most its share (:meth:`.index.ChunkIndex.pin_room`); a pin is charged the
  chunk's extent, the bytes it holds in the pool.
- The store that holds the tier listens on its links (:class:`..base.TierLinks`):
  ``evicted(key, chunk, lend)`` is called with a leased :class:`Chunk` of each
  evicted entry, so the tiered store can spill it to a lower tier.  When a put
  is waiting for the room (``lend`` False) the receiver copies what it needs
  and the lease ends on return.  With ``spill_ahead_bytes`` set, the tier also
  evicts *ahead*, after an allocation, until that many bytes are free or on
  their way out; those chunks are *lent* (``lend`` True): the receiver may keep
  the lease, e.g. to write the bytes to disk straight from the pool, and the
  extent is reused only after it releases it.  ``evicted`` returning False
  declines a lent chunk, which then stays stored.

Accounting is exact: ``stored_bytes`` counts payload bytes, ``allocated_bytes``
what the allocator handed out (payload rounded up to 4 KiB pages: extents),
``pinned_bytes`` and the tenants' quotas the extents of their chunks, and
``evictable_bytes`` the extents of stored chunks neither leased nor pinned, kept
up to date on every change so that a put under pressure asks in O(1) whether
evicting could make room at all.

:class:`MemoryTier` is a front that builds and holds its parts, one job each:
its ``index`` (:class:`.index.ChunkIndex`: the state, entries, leases, removal
and accounts) and its ``eviction`` (:class:`.eviction.TierEviction`, on the
index: allocation, eviction, waiting for lent room, quotas); the tier itself
does the reads, the two-phase write, pins, the warm-restart hooks and stats.
The two-phase write has the words the tiered store and docs/protocol.md use:
``reserve`` room for a key (the wire's ``alloc``), fill it, then ``commit`` it
(visible) or ``abort`` it (the wire's ``release`` of a write lease).

Primitives: :class:`MemoryTier` (``get``, ``put``, ``reserve`` /
``commit`` / ``abort``, ``reserve_room`` / ``bind_room``,
``lease``, ``delete``, ``clear``, ``pin``, ``unpin``, ``snapshot``, ``adopt``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from lmcache_client.protocol import PutStatus

from ..base import Chunk, ChunkKey, TierLinks
from ..policy import EvictionPolicy
from ..tenants import TenantQuotas
from . import warm
from .allocator import ExtentAllocator, extent_of
from .entry import UNBOUND, Reservation, pack, packable, unpack
from .entry import Entry as _Entry
from .entry import canonical as _canonical
from .eviction import TierEviction
from .index import ChunkIndex, PinRoom, TierCounters
from .pool import MemoryPool

logger = logging.getLogger(__name__)


class MemoryTier:
    """The memory tier (see the module): a front that builds and holds its
    ``index`` (:class:`.index.ChunkIndex`: the state, entries, leases, removal,
    accounts) and its ``eviction`` (:class:`.eviction.TierEviction`, on the index)."""

    name = "memory"

    def __init__(
        self,
        pool: MemoryPool,
        max_pinned_bytes: int,
        policy: EvictionPolicy | None = None,
        *,
        links: TierLinks | None = None,
        quotas: TenantQuotas | None = None,
    ):
        self.index = ChunkIndex(self.name, pool, max_pinned_bytes, policy, links=links, quotas=quotas)
        self.eviction = TierEviction(self.index)

    # -- the index's state, read by the store, the server, the metrics and the tests --
    @property
    def pool(self) -> MemoryPool:
        return self.index.pool

    @property
    def allocator(self) -> ExtentAllocator:
        return self.index.allocator

    @property
    def policy(self) -> EvictionPolicy:
        return self.index.policy

    @property
    def links(self) -> TierLinks:
        return self.index.links

    @property
    def counters(self) -> TierCounters:
        return self.index.counters

    @property
    def quotas(self) -> TenantQuotas:
        return self.index.quotas

    @property
    def max_pinned_bytes(self) -> int:
        return self.index.max_pinned_bytes

    @property
    def stored_bytes(self) -> int:
        return self.index.stored_bytes

    @property
    def pinned_bytes(self) -> int:
        return self.index.pinned_bytes

    @property
    def leased_chunks(self) -> int:
        return self.index.leased_chunks

    @property
    def evictable_bytes(self) -> int:
        return self.index.evictable_bytes

    @property
    def dying_bytes(self) -> int:
        return self.index.dying_bytes

    @property
    def lent_bytes(self) -> int:
        return self.index.lent_bytes

    def pinned_in(self, namespace: str) -> tuple[int, int]:
        return self.index.pinned_in(namespace)

    def pin_room(self, namespace: str) -> PinRoom:
        return self.index.pin_room(namespace)

    # -- room (:mod:`.eviction`) ---------------------------------------------------------
    def room_coming(self, size: int) -> bool:
        return self.eviction.room_coming(size)

    async def wait_for_room(self, timeout_s: float) -> bool:
        return await self.eviction.wait_for_room(timeout_s)

    # -- reads ---------------------------------------------------------------------
    async def get(self, key: ChunkKey) -> Chunk | None:
        found = self.index.entries.get(key)
        if found is None:
            self.index.counters.misses += 1
            return None
        self.index.counters.hits += 1
        self.index.touch(key, found)
        return self.index.lease_entry(self.index.entry(key, found))

    async def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [k in self.index.entries for k in keys]

    def peek(self, key: ChunkKey) -> bool:
        """Whether ``key`` is stored, without touching recency or counters."""
        return key in self.index.entries

    def peek_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        index = self.index.entries
        return [key in index for key in keys]

    # -- writes --------------------------------------------------------------------
    async def put(self, key: ChunkKey, data: Any, parent: ChunkKey | None = None) -> PutStatus:
        """Store ``data`` under ``key``; ``parent`` is the chunk before it in its
        prefix chain when known (a hint for the policy)."""
        src = memoryview(data).cast("B")
        reservation = self.reserve(key, src.nbytes, parent)
        if not isinstance(reservation, Reservation):
            return reservation
        # Copy first, index after: a chunk is visible only once complete.
        reservation.view[:] = src
        return self.commit(reservation)

    def reserve(self, key: ChunkKey, size: int, parent: ChunkKey | None = None) -> Reservation | PutStatus:
        """Phase one of a store: room for ``size`` bytes, invisible to readers.

        Returns a Reservation to fill and then :meth:`commit` or
        :meth:`abort`, or the PutStatus explaining why there is none.
        """
        refused = self._refusal(key, size, parent)
        if refused is not None:
            return refused
        key = _canonical(key)
        offset = self.eviction.allocate(size)
        if offset is not None and not self.index.pool.ensure_pages(offset, size):
            self.index.allocator.free(offset, size)  # the shared-memory filesystem is full
            offset = None
        if offset is None:
            if not self.eviction.room_coming(size):  # else the caller may wait for it (and counts it if not)
                self.index.counters.rejections += 1
            return PutStatus.NO_SPACE
        reservation = Reservation(key, offset, size, parent, self.index.pool.view[offset : offset + size])
        self._charge(reservation)
        self.index.claims[key] = reservation
        return reservation

    def _charge(self, reservation: Reservation) -> None:
        """Reserve ``reservation``'s extent in its tenant's quota until it commits or is aborted."""
        reservation.charged = extent_of(reservation.size)
        self.index.quotas.account_reserved(reservation.key.namespace, reservation.charged)

    def _discharge(self, reservation: Reservation) -> None:
        self.index.quotas.account_reserved(reservation.key.namespace, -reservation.charged)
        reservation.charged = 0

    def _unclaim(self, reservation: Reservation) -> None:
        if self.index.claims.get(reservation.key) is reservation:
            del self.index.claims[reservation.key]

    def _refusal(self, key: ChunkKey, size: int, parent: ChunkKey | None) -> PutStatus | None:
        """Why ``key`` may not be stored (EXISTS, TOO_LARGE, SKIPPED, NO_SPACE over
        its tenant's quota), else None: the checks of a store before it takes room."""
        existing = self.index.entries.get(key)
        if existing is not None and not self._replaced_wrong_size(key, existing, size):
            self.index.touch(key, existing)
            return PutStatus.EXISTS
        if key in self.index.claims:
            return PutStatus.EXISTS  # another writer's store of it is under way: first writer wins
        key = _canonical(key)
        if size > self.index.allocator.capacity:
            self.index.counters.rejections += 1
            return PutStatus.TOO_LARGE
        if not self.index.policy.admit(key, size, parent):
            self.index.counters.skipped += 1
            return PutStatus.SKIPPED
        if self.index.quotas and not self.eviction.within_quota(key, size):
            self.index.counters.rejections += 1
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
        self.index.remove(self.index.entry(key, found))
        self.index.counters.replaced_wrong_size += 1
        logger.warning("chunk %s/%s stored with %d bytes replaced by a put of %d bytes",
                       key.namespace, key.digest.hex()[:16], entry_size, size)  # fmt: skip
        return True

    def commit(self, reservation: Reservation) -> PutStatus:
        """Phase two: make a filled reservation visible (EXISTS if the key was stored meanwhile)."""
        r = reservation
        self._unclaim(r)
        self._discharge(r)
        if r.key in self.index.entries:
            self.index.allocator.free(r.offset, r.size)
            return PutStatus.EXISTS
        key = _canonical(r.key)
        self.index.entries[key] = pack(r.offset, r.size) if packable(r.offset, r.size) else _Entry(
            key, r.offset, r.size, extent_of(r.size))  # fmt: skip
        self.index.evictable_bytes += extent_of(r.size)
        self.index.policy.inserted(key, r.size, r.parent)
        self.index.account(key, r.size, +1)
        self.index.counters.stores += 1
        return PutStatus.STORED

    def abort(self, reservation: Reservation) -> None:
        self._unclaim(reservation)
        self._discharge(reservation)
        self.index.allocator.free(reservation.offset, reservation.size)

    def reserve_room(self, size: int) -> Reservation | None:
        """Room for ``size`` bytes bound to no key yet (key :data:`UNBOUND`: a staged
        shared-memory slot), evicting as a store would; None when there is none.
        Give it back with :meth:`abort`, or :meth:`bind_room` it."""
        if size > self.index.allocator.capacity:
            return None
        offset = self.eviction.allocate(size)
        if offset is not None and not self.index.pool.ensure_pages(offset, size):
            self.index.allocator.free(offset, size)
            offset = None
        if offset is None:
            return None
        return Reservation(UNBOUND, offset, size, None, self.index.pool.view[offset : offset + size])

    def bind_room(self, room: Reservation, key: ChunkKey, parent: ChunkKey | None = None) -> Reservation | PutStatus:
        """:meth:`reserve` for ``key`` over ``room`` (from :meth:`reserve_room`):
        the same checks, then a Reservation of that room to :meth:`commit`;
        or the PutStatus saying why not (``room`` stays reserved, unbound)."""
        refused = self._refusal(key, room.size, parent)
        if refused is not None:
            return refused
        bound = Reservation(_canonical(key), room.offset, room.size, parent, room.view)
        self._charge(bound)
        return bound

    def lease(self, key: ChunkKey) -> Chunk | None:
        """A leased view of a stored chunk without counting a hit or touching recency."""
        found = self.index.entries.get(key)
        if found is None:
            return None
        return self.index.lease_entry(self.index.entry(key, found))

    async def delete(self, key: ChunkKey) -> bool:
        found = self.index.entries.get(key)
        if found is None:
            return False
        self.index.remove(self.index.entry(key, found))
        return True

    async def clear(self, namespace: str | None) -> int:
        victims = [k for k in self.index.entries if namespace is None or k.namespace == namespace]
        for key in victims:
            self.index.remove(self.index.entry(key))
        return len(victims)

    # -- pins ----------------------------------------------------------------------
    def pin(self, key: ChunkKey) -> bool:
        """Keep ``key`` from eviction until unpinned (True also when it was pinned
        already); False when memory does not hold it or its extent does not fit
        the room left to pin (:meth:`pin_room`)."""
        found = self.index.entries.get(key)
        if found is None:
            return False
        if not isinstance(found, int) and found.pinned:
            return True
        size = unpack(found)[1] if isinstance(found, int) else found.size
        if extent_of(size) > self.index.pin_room(key.namespace).left:
            return False
        entry = self.index.entry(key, found)
        entry.pinned = True
        self.index.account_pin(key, entry.extent, +1)
        if not entry.leases:
            self.index.evictable_bytes -= entry.extent
        self.index.policy.removed(key)
        return True

    def pin_cost(self, key: ChunkKey) -> int | None:
        """Bytes pinning ``key`` would add to ``pinned_bytes`` (its extent): 0 when
        it is pinned already, None when memory does not hold it."""
        found = self.index.entries.get(key)
        if found is None:
            return None
        if isinstance(found, int):
            return extent_of(unpack(found)[1])
        return 0 if found.pinned else found.extent

    def unpin(self, key: ChunkKey) -> bool:
        entry = self.index.entries.get(key)
        if entry is None or isinstance(entry, int) or not entry.pinned:
            return False
        entry.pinned = False
        self.index.account_pin(entry.key, entry.extent, -1)
        if not entry.leases:
            self.index.evictable_bytes += entry.extent
        self.index.policy.inserted(entry.key, entry.size, None)
        self.index.repack(entry)
        return True

    # -- warm restarts (storage/memory/warmstart.py; the work is in storage/memory/warm.py) --
    def snapshot(self) -> list[tuple[ChunkKey, int, int, bool]]:
        """Every stored chunk as ``(key, offset, size, pinned)``, next victim first
        (pinned chunks last): what the next daemon needs to adopt the pool."""
        return warm.snapshot(self.index)

    def adopt(self, chunks: Sequence[tuple[ChunkKey, int, int, bool]], held: Sequence[tuple[int, int]]) -> None:
        """Take over a pool left by a clean stop (see :func:`.warm.adopt`)."""
        warm.adopt(self.index, chunks, held, self.pin)

    def held_chunk(self, offset: int, size: int, held: dict[int, _Entry] | None = None) -> Chunk:
        """A leased view of a held extent of a read lease whose chunk is gone
        (deleted or evicted before the restart), freed when the lease ends
        (``held``: see :func:`.warm.held_chunk`)."""
        return warm.held_chunk(self.index, offset, size, held)

    # -- introspection -------------------------------------------------------------
    @property
    def chunks(self) -> int:
        return len(self.index.entries)

    def keys(self) -> list[ChunkKey]:
        return list(self.index.entries)

    def namespaces(self) -> dict[str, tuple[int, int]]:
        return {ns: (c[0], c[1]) for ns, c in self.index.by_namespace.items()}

    def stats(self) -> dict[str, Any]:
        a = self.index.allocator
        return {
            "capacity_bytes": a.capacity,
            "stored_bytes": self.index.stored_bytes,
            "allocated_bytes": a.allocated_bytes,
            "free_bytes": a.free_bytes,
            "largest_free_bytes": a.largest_free,
            "free_extents": a.free_extents,
            "fragmentation": round(a.fragmentation, 4),
            "chunks": self.chunks,
            "pinned_bytes": self.index.pinned_bytes,
            "leased_chunks": self.index.leased_chunks,
            "evictable_bytes": self.index.evictable_bytes,
            "page_locked": self.index.pool.pinned,
            "policy": self.index.policy.name,
            **(self.index.policy.stats() if hasattr(self.index.policy, "stats") else {}),
            **({"tenants": self.index.quotas.stats()} if self.index.quotas else {}),
            **dataclasses.asdict(self.index.counters),
        }

    async def close(self, keep_segment: bool = False) -> None:
        """Forget every chunk and close the pool; with ``keep_segment`` its shared segment
        stays for the next daemon (a warm restart wrote its index)."""
        self.index.entries.clear()
        self.index.evictable_bytes = 0
        self.index.pool.close(keep_segment=keep_segment)
