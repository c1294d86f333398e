"""The tiered store's promotions (:class:`TieredPromotion`, a base of :class:`.tiered.TieredStore`):
copying chunks of a lower tier (disk, Redis) into memory.

- ``fill_from_disk`` reads a disk chunk straight into reserved pool memory (one
  copy); ``fill_from`` copies a chunk already read from a lower tier into the
  pool, off the event loop.  Both answer with the memory tier's status (STORED:
  promoted and counted in ``promotions``; EXISTS: memory holds it already; a
  refusal: no room), so a get (``promote``, ``promote_from_disk`` in
  :mod:`.tiered`) and a prefetch share one way into memory.
- ``prefetch_sizes`` / ``prefetch``: what a lookup with ``prefetch`` asks for
  (docs/protocol.md §5.5): the keys that a lower tier holds and memory does not,
  their sizes (the disk's index; Redis: one STRLEN round trip), and the promotion
  of a batch of them (the disk files concurrently, Redis in one round trip), with
  nothing leased and nothing counted as a memory hit or miss.  The caller (the
  server's :class:`~lmcache_server.server.prefetch.Prefetcher`) bounds them by
  the in-flight byte budget.

A cancelled promotion gives its room back once the thread writing into it has
finished (:func:`.filling.fill_reservation`).

Primitives: :func:`in_memory`, :class:`TieredPromotion` (``fill_from``, ``fill_from_disk``,
``prefetch_sizes``, ``prefetch``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence

from lmcache_client.keys import ChunkTokens
from lmcache_client.protocol import PutStatus

from .base import Chunk, ChunkKey, Residency
from .disk import DiskTier
from .filling import Filling, fill_reservation
from .memory import MemoryTier, Reservation
from .offload import Offload
from .remote import RedisTier
from .tieradmission import StoreAdmission


def in_memory(events: Residency | None, key: ChunkKey, tokens: ChunkTokens | None, memory: str) -> None:
    """``key`` became readable in memory (a put, a promotion): announced with ``tokens``
    when it was not, else its medium is memory's again (it was only on disk or in Redis)."""
    if events is None:
        return
    if tokens is not None:
        events.stored(key, tokens, memory)  # (nothing when announced already)
    if events.announced(key):
        events.moved(key, memory)  # (nothing when announced in memory)


class TieredPromotion:
    """The promotions of :class:`.tiered.TieredStore`; the store's ``__init__`` sets the
    attributes below."""

    memory: MemoryTier
    disk: DiskTier | None
    remote: RedisTier | None
    filling: Filling
    offload: Offload
    promotions: dict[str, int]
    admission: StoreAdmission | None
    events: Residency | None

    async def fill_from(self, tier: str, key: ChunkKey, chunk: Chunk) -> PutStatus | None:
        """Copy ``chunk`` (read from ``tier``) into the pool, off the loop: STORED when
        promoted, the memory tier's refusal when there is no room (EXISTS: it holds
        the key already), None when the copy failed."""
        reservation = self.memory.prepare_store(key, chunk.nbytes)
        if not isinstance(reservation, Reservation):
            return reservation

        async def fill() -> bool:
            await self.offload.copy(reservation.view, chunk.data)
            return True

        status = await fill_reservation(self.memory, reservation, fill())
        if status is PutStatus.STORED:
            self.promotions[tier] += 1
            in_memory(self.events, key, chunk.tokens, self.memory.name)  # its record's ids announce it
            if self.admission is not None and self.remote is not None and tier == self.remote.name:
                self.admission.from_remote(key)  # Redis holds it: no write owed
        return status

    async def fill_from_disk(self, disk: DiskTier, key: ChunkKey) -> PutStatus | None:
        """Read a disk chunk straight into reserved pool memory (one copy): STORED when
        promoted, the memory tier's refusal when there is no room, None when the disk
        does not hold it (or its read failed)."""
        size = disk.payload_size(key)
        if size is None:
            return None
        reservation = self.memory.prepare_store(key, size)
        if not isinstance(reservation, Reservation):
            return reservation

        async def fill() -> bool:
            return await disk.get(key, reservation.view) is not None

        status = await fill_reservation(self.memory, reservation, fill())
        if status is PutStatus.STORED:
            self.promotions[disk.name] += 1
            in_memory(self.events, key, None, self.memory.name)
        return status

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

    async def _from_remote(self, remote: RedisTier, keys: Sequence[ChunkKey]) -> list[int]:
        found = await remote.get_many(keys)
        hits = [(key, chunk) for key, chunk in zip(keys, found) if chunk is not None]
        statuses = await asyncio.gather(*(self.fill_from(remote.name, k, c) for k, c in hits), return_exceptions=True)
        for _, chunk in hits:
            chunk.release()
        for status in statuses:
            if isinstance(status, BaseException):
                raise status
        return [c.nbytes for (_, c), s in zip(hits, statuses) if s is PutStatus.STORED]
