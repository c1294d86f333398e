"""The tiered store's promotions (:class:`Promotion`, a part of :class:`.store.TieredStore`):
copying chunks of a lower tier (disk, Redis) into memory.

- ``fill_from_disk`` reads a disk chunk straight into reserved pool memory (one
  copy); ``fill_from`` copies a chunk already read from a lower tier into the
  pool, off the event loop.  Both answer with the memory tier's status (STORED:
  promoted and counted in ``promotions``; EXISTS: memory holds it already; a
  refusal: no room), so a get (``promote``, ``promote_from_disk``: the pool
  copy, leased, for :mod:`.reads`) and a prefetch share one way into memory.
- ``prefetch_sizes`` / ``prefetch``: what a lookup with ``prefetch`` asks for
  (docs/protocol.md §5.5): the keys that a lower tier holds and memory does not,
  their sizes (the disk's index; Redis: one STRLEN round trip), and the promotion
  of a batch of them (the disk files concurrently, Redis in one round trip), with
  nothing leased and nothing counted as a memory hit or miss.  The caller (the
  server's :class:`~lmcache_server.server.prefetch.Prefetcher`) bounds them by
  the in-flight byte budget.

A cancelled promotion gives its room back once the thread writing into it has
finished (:func:`.filling.fill_reservation`).

Primitives: :class:`Promotion` (``fill_from``, ``fill_from_disk``, ``promote``,
``promote_from_disk``, ``prefetch_sizes``, ``prefetch``, ``counts``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence

from lmcache_client.protocol import PutStatus

from ..base import Chunk, ChunkKey
from ..memory import Reservation
from ..offload import Offload
from .filling import Filling, fill_reservation
from .gate import StoreGate
from .residence import Residence
from .roles import SpillTarget, Tiers, Uplink


class Promotion:
    """Copies into memory; ``counts``: promotions per lower tier's name."""

    def __init__(self, tiers: Tiers, filling: Filling, offload: Offload, residence: Residence, gate: StoreGate | None):
        self.memory = tiers.memory
        self.disk = tiers.disk
        self.remote = tiers.remote
        self.filling = filling
        self.offload = offload
        self.residence = residence
        self.gate = gate
        self.counts: dict[str, int] = {t.name: 0 for t in tiers.lower}

    async def fill_from(self, tier: str, key: ChunkKey, chunk: Chunk) -> PutStatus | None:
        """Copy ``chunk`` (read from ``tier``) into the pool, off the loop: STORED when
        promoted, the memory tier's refusal when there is no room (EXISTS: it holds
        the key already), None when the copy failed."""
        reservation = self.memory.reserve(key, chunk.nbytes)
        if not isinstance(reservation, Reservation):
            return reservation

        async def fill() -> bool:
            await self.offload.copy(reservation.view, chunk.data)
            return True

        status = await fill_reservation(self.memory, reservation, fill())
        if status is PutStatus.STORED:
            self.counts[tier] += 1
            self.residence.in_memory(key, chunk.tokens, self.memory.name)  # its record's ids announce it
            if self.gate is not None and self.remote is not None and tier == self.remote.name:
                self.gate.from_remote(key)  # Redis holds it: no write owed
        return status

    async def fill_from_disk(self, disk: SpillTarget, key: ChunkKey) -> PutStatus | None:
        """Read a disk chunk straight into reserved pool memory (one copy): STORED when
        promoted, the memory tier's refusal when there is no room, None when the disk
        does not hold it (or its read failed)."""
        size = disk.payload_size(key)
        if size is None:
            return None
        reservation = self.memory.reserve(key, size)
        if not isinstance(reservation, Reservation):
            return reservation

        async def fill() -> bool:
            return await disk.get(key, reservation.view) is not None

        status = await fill_reservation(self.memory, reservation, fill())
        if status is PutStatus.STORED:
            self.counts[disk.name] += 1
            self.residence.in_memory(key, None, self.memory.name)
        return status

    async def promote(self, tier: str, key: ChunkKey, chunk: Chunk) -> Chunk:
        """Copy a lower-tier hit into the pool (off the loop) and serve the pool copy,
        leased like any memory hit (zero-copy and shared-memory replies need it
        there); the hit as read when there is no room."""
        status = await self.fill_from(tier, key, chunk)
        promoted = self.memory.lease(key) if status in (PutStatus.STORED, PutStatus.EXISTS) else None
        if promoted is None:
            return chunk
        chunk.release()
        return promoted

    async def promote_from_disk(self, disk: SpillTarget, key: ChunkKey) -> Chunk | None:
        """Read a disk chunk straight into reserved pool memory (one copy, then a
        zero-copy send); None if it is not on disk or there is no room."""
        status = await self.fill_from_disk(disk, key)
        if status is not None and status not in (PutStatus.STORED, PutStatus.EXISTS):
            return None  # no room
        return self.memory.lease(key)  # None: not on disk, or its read failed

    # -- prefetch --------------------------------------------------------------------
    async def prefetch_sizes(self, keys: Sequence[ChunkKey]) -> dict[ChunkKey, int]:
        """The keys (in order) that memory does not hold and the disk or Redis does,
        with their sizes in bytes: the disk's payload size, or the size of the Redis
        record (the payload and a small header: an estimate from above)."""
        out: dict[ChunkKey, int] = {}
        remote: list[ChunkKey] = []
        for key in keys:
            if key in out or key in self.filling or self.memory.peek(key):
                continue
            size = self.disk.payload_size(key) if self.disk is not None else None
            if size is not None:
                out[key] = size
            elif self.remote is not None:
                remote.append(key)
                out[key] = 0  # a place in the order; sized below
        if remote:
            assert self.remote is not None
            for key, size in zip(remote, await self.remote.value_sizes(remote)):
                out[key] = size
        return {key: size for key, size in out.items() if size}

    async def prefetch(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Promote each key from the disk (concurrently) or else Redis (one round trip)
        into memory; the payload bytes of each chunk this promoted (what memory already
        held, had no room for, or no tier holds any more is left out).  Every promotion
        runs to its end before an error is raised."""
        disk = self.disk
        on_disk = {k for k in keys if disk is not None and disk.payload_size(k) is not None}
        jobs: list[Awaitable[int | list[int]]] = [self._from_disk(k) for k in keys if k in on_disk]
        rest = [k for k in keys if k not in on_disk]
        if rest and self.remote is not None:
            jobs.append(self._from_remote(self.remote, rest))
        sizes: list[int] = []
        error: BaseException | None = None
        for result in await asyncio.gather(*jobs, return_exceptions=True):
            if isinstance(result, BaseException):
                error = error or result
            elif isinstance(result, list):
                sizes += result
            elif result:
                sizes.append(result)
        if error is not None:
            raise error
        return sizes

    async def _from_disk(self, key: ChunkKey) -> int:
        assert self.disk is not None
        size = self.disk.payload_size(key) or 0
        return size if await self.fill_from_disk(self.disk, key) is PutStatus.STORED else 0

    async def _from_remote(self, remote: Uplink, keys: Sequence[ChunkKey]) -> list[int]:
        found = await remote.get_many(keys)
        hits = [(key, chunk) for key, chunk in zip(keys, found) if chunk is not None]
        statuses = await asyncio.gather(*(self.fill_from(remote.name, k, c) for k, c in hits), return_exceptions=True)
        for _, chunk in hits:
            chunk.release()
        for status in statuses:
            if isinstance(status, BaseException):
                raise status
        return [c.nbytes for (_, c), s in zip(hits, statuses) if s is PutStatus.STORED]
