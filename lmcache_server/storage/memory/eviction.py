"""The memory tier's room: allocation, eviction (for a put, and ahead for the
spill), waiting for lent room, and the tenants' quotas (a part
:class:`.tier.MemoryTier` builds and holds, on its :class:`.index.ChunkIndex`).

- A put that does not fit evicts the policy's victims until it does; leased and
  pinned chunks are never victims, and ``evictable_bytes`` says in O(1) whether
  evicting could make room at all.
- With a disk tier the victims are *lent* to the spill (``evicted(key, chunk,
  True)`` on the tier's :class:`..base.TierLinks`): their extents come back once
  written, and :meth:`TierEviction.room_coming` / :meth:`TierEviction.wait_for_room`
  let a put wait for them.
- A tenant over its quota evicts its own chunks first; the quota counts extents
  (bytes held in the pool), never payload bytes.

Primitives: :class:`TierEviction` (``room_coming``, ``wait_for_room``, ``allocate``,
``_evict``, ``within_quota``).
"""

from __future__ import annotations

import asyncio

from ..base import ChunkKey
from ..tenants import tenant_of
from .allocator import extent_of
from .entry import Entry as _Entry
from .index import ChunkIndex


class TierEviction:
    """Room for new chunks in a memory tier (see the module), on its ``index``."""

    def __init__(self, index: ChunkIndex):
        self.index = index

    def room_coming(self, size: int) -> bool:
        """Whether chunks lent to the spill will free room for ``size`` bytes once written."""
        return bool(self.index.lent_bytes) and self.index.allocator.free_bytes + self.index.lent_bytes >= extent_of(
            size
        )

    async def wait_for_room(self, timeout_s: float) -> bool:
        """Wait until an extent of a removed chunk is freed (False: ``timeout_s`` passed first)."""
        self.index.room.clear()
        try:
            await asyncio.wait_for(self.index.room.wait(), max(timeout_s, 0.0))
        except TimeoutError:
            return False
        return True

    def allocate(self, size: int) -> int | None:
        offset = self.index.allocator.alloc(size)
        if offset is None:
            offset = self._evict_for(size)
        if offset is not None and self.index.spill_ahead_bytes:
            self._evict_ahead()
        return offset

    def _evict_for(self, size: int) -> int | None:
        """Evict the policy's victims until the allocation fits; chunks being read
        (leased) are never victims.  With a disk tier the victims are lent to it
        (written straight from the pool: copying 32 MiB here would stall the
        event loop), so their room comes back only once written: None then, and
        :meth:`room_coming` says the caller may wait for it."""
        if (self.index.pinned_bytes or self.index.leased_chunks) and not self._could_fit(size):
            return None  # refuse without evicting chunks for nothing
        while not self.room_coming(size) and (key := self.index.policy.victim(self.index.is_leased)) is not None:
            self._evict_lending(self.index.entry(key))
            offset = self.index.allocator.alloc(size)
            if offset is not None:
                return offset
        return None

    def _evict_lending(self, entry: _Entry) -> None:
        """Evict ``entry``, lent to the spill when a disk tier takes it, else at once."""
        if not (self.index.lends_spills and self._evict(entry, lend=True)):
            # A spill declined (queue full): dropped, no copy.  Its lease ended, so the
            # index may hold the entry packed again: evict the index's entry, not a stale copy.
            self._evict(self.index.entry(entry.key), lend=False)

    def _evict_ahead(self) -> None:
        """Lend victims to the spill until ``spill_ahead_bytes`` (at most an eighth
        of the pool) are free or on their way out, so that the next puts find
        room without waiting for a copy."""
        target = min(self.index.spill_ahead_bytes, self.index.allocator.capacity // 8)
        while self.index.allocator.free_bytes + self.index.dying_bytes < target:
            key = self.index.policy.victim(self.index.is_leased)
            if key is None or not self._evict(self.index.entry(key), lend=True):
                return

    def _evict(self, entry: _Entry, lend: bool) -> bool:
        """Evict ``entry`` (False: the receiver declined a lent chunk; it stays)."""
        listener = self.index.links.listener
        if listener is not None:
            chunk = self.index.lease_entry(entry)
            taken = listener.evicted(entry.key, chunk, lend)
            if not lend:
                chunk.release()
            elif not taken:
                chunk.release()
                return False
            elif entry.leases:  # still lent: its extent is freed when the spill is written
                entry.lent = True
                self.index.lent_bytes += entry.extent
        self.index.remove(entry)
        self.index.counters.evictions += 1
        self.index.counters.evicted_bytes += entry.size
        return True

    def within_quota(self, key: ChunkKey, size: int) -> bool:
        """Evict the key's tenant's own chunks until a chunk of ``size`` payload
        bytes fits its quota (storage/tenants.py), charged its extent (the bytes
        it will hold in the pool); False when they cannot."""
        found = self.index.quotas.limit_for(key.namespace)
        if found is None:
            return True
        tenant, limit = found
        size = extent_of(size)
        if size > limit:
            return False

        def not_theirs(k: ChunkKey) -> bool:
            return self.index.is_leased(k) or tenant_of(k.namespace) != tenant

        while self.index.quotas.used(tenant) + self.index.quotas.reserved(tenant) + size > limit:
            victim = self.index.policy.victim(not_theirs)
            if victim is None:
                return False
            self._evict_lending(self.index.entry(victim))
            self.index.quotas.evictions[tenant] += 1
        return True

    def _could_fit(self, size: int) -> bool:
        """Whether evicting every evictable chunk would free enough bytes (O(1):
        ``evictable_bytes`` is kept current; asked when pinned or leased chunks
        make the answer uncertain)."""
        return self.index.allocator.free_bytes + self.index.evictable_bytes >= extent_of(size)
