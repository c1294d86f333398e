"""A get of many keys through the tiers, each lower tier read for the whole batch at once.

The tiered store's ``get_many`` is written here (:class:`Reads`, a part of
:class:`.store.TieredStore`), in passes over the batch:

1. memory: each key (after any fill of it by a put has ended) is leased from
   the pool, or is a miss (each distinct key, hit or miss, is recorded in the
   sizing telemetry's ``get`` window when it is on, :mod:`..sizing`);
2. disk: every memory miss the disk holds is read straight into reserved pool
   memory, all of them at once: the disk tier's I/O threads
   (``disk_io_threads``) read that many files concurrently;
3. the lower tiers again, in order, for what is still missing: the disk (a
   hit there with no room in the pool is served from a copy), read
   concurrently; then Redis, every key in one round trip
   (:meth:`..remote.RemoteTier.get_many`), its hits promoted into the pool
   concurrently (copies off the event loop).

Results keep the keys' order.  A key repeated within the batch is read once
by the passes and its repeats afterwards, one by one (a lease of the promoted
chunk each).  Nothing leaks: when one read of a pass fails, the others of that
pass still run to their end, then every lease and copy already taken is
released and the first error propagates; a cancelled batch cancels its reads
(a read into the pool gives its room back once its thread is done, see
:func:`.filling.fill_reservation`) and releases whatever they still return.

A key hit in any tier is told to the gate (``accessed``).

Primitives: :class:`Reads` (``get_many``), :func:`read_batch`, over any :class:`Source`
(a :class:`Reads` is one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from ..base import Chunk, ChunkKey, Tier
from ..sizing import Sizing
from .roles import Memory, SpillTarget, Tiers, Uplink


class Fills(Protocol):
    """The puts still copying into the pool (:class:`.filling.Filling` is one)."""

    async def filled(self, key: ChunkKey) -> None: ...


class Promotes(Protocol):
    """The copies of lower-tier hits into the pool (:class:`.promotion.Promotion` is one)."""

    async def promote(self, tier: str, key: ChunkKey, chunk: Chunk) -> Chunk: ...

    async def promote_from_disk(self, disk: SpillTarget, key: ChunkKey) -> Chunk | None: ...


class Source(Protocol):
    """What a batch read needs: the tiers, the fills, the promotions and the sizing
    telemetry (:class:`Reads` is one)."""

    @property
    def memory(self) -> Memory: ...
    @property
    def disk(self) -> SpillTarget | None: ...
    @property
    def remote(self) -> Uplink | None: ...
    @property
    def lower(self) -> list[Tier]: ...
    @property
    def filling(self) -> Fills: ...
    @property
    def sizing(self) -> Sizing | None: ...
    @property
    def promotion(self) -> Promotes: ...


class Reads:
    """The store's gets; ``accessed``: told each key hit (None: no gate to tell)."""

    def __init__(
        self,
        tiers: Tiers,
        filling: Fills,
        promotion: Promotes,
        sizing: Sizing | None,
        accessed: Callable[[ChunkKey], None] | None,
    ):
        self.memory = tiers.memory
        self.disk = tiers.disk
        self.remote = tiers.remote
        self.lower = tiers.lower
        self.filling = filling
        self.promotion = promotion
        self.sizing = sizing
        self._accessed = accessed

    async def get_many(self, namespace: str, digests: Sequence[bytes]) -> list[Chunk | None]:
        """One Chunk per hit (release each: memory hits are leased), None per miss,
        in the order asked.  Each lower tier is read for the whole batch at once:
        disk reads run concurrently (up to the disk's I/O threads), Redis is one
        round trip.  If a tier read fails, the leases already taken are released
        before the error propagates."""
        keys = [ChunkKey(namespace, d) for d in digests]
        chunks = await read_batch(self, keys)
        if self._accessed is not None:
            for key, chunk in zip(keys, chunks):
                if chunk is not None:
                    self._accessed(key)
        return chunks


async def read_batch(store: Source, keys: Sequence[ChunkKey]) -> list[Chunk | None]:
    """One Chunk per hit (release each), None per miss, in the order of ``keys``."""
    out: list[Chunk | None] = [None] * len(keys)
    first: dict[ChunkKey, int] = {}
    repeats: list[int] = []
    for i, key in enumerate(keys):
        if key in first:
            repeats.append(i)
        else:
            first[key] = i
    try:
        for i in first.values():
            await store.filling.filled(keys[i])
            out[i] = await store.memory.get(keys[i])
        missing = [i for i in first.values() if out[i] is None]
        if store.sizing is not None and keys:  # the get window: each distinct key, a hit if memory had it
            firsts = list(first.values())  # (get_many reads one namespace)
            store.sizing.get.record(
                keys[0].namespace, [keys[i].digest for i in firsts], [out[i] is not None for i in firsts]
            )
        disk = store.disk
        if disk is not None and missing:
            await _each(out, missing, lambda i: store.promotion.promote_from_disk(disk, keys[i]))
            missing = [i for i in missing if out[i] is None]
        for tier in store.lower:
            if not missing:
                break
            if tier is store.remote:
                await _from_remote(store, keys, out, missing)
            else:
                await _each(out, missing, _read_and_promote(store, tier, keys))
            missing = [i for i in missing if out[i] is None]
        for i in repeats:
            out[i] = await _one(store, keys[i])
    except BaseException:
        for chunk in out:
            if chunk is not None:
                chunk.release()
        raise
    return out


def _read_and_promote(store: Source, tier: Tier, keys: Sequence[ChunkKey]) -> Callable[[int], Awaitable[Chunk | None]]:
    async def read(i: int) -> Chunk | None:
        chunk = await tier.get(keys[i])
        return None if chunk is None else await store.promotion.promote(tier.name, keys[i], chunk)

    return read


async def _from_remote(store: Source, keys: Sequence[ChunkKey], out: list[Chunk | None], missing: list[int]) -> None:
    """Redis: every missing key in one round trip, then the hits promoted concurrently."""
    remote = store.remote
    assert remote is not None
    found = await remote.get_many([keys[i] for i in missing])
    hits = {i: chunk for i, chunk in zip(missing, found) if chunk is not None}
    # (the hits are copies, leased nowhere: one that a failed batch never promotes just goes)
    await _each(out, list(hits), lambda i: store.promotion.promote(remote.name, keys[i], hits[i]))


async def _one(store: Source, key: ChunkKey) -> Chunk | None:
    """A repeated key of the batch: its first occurrence was just read (and promoted
    when there was room), so it is read again the same way, on its own."""
    chunk = await store.memory.get(key)
    if chunk is None and store.disk is not None:
        chunk = await store.promotion.promote_from_disk(store.disk, key)
    if chunk is None:
        for tier in store.lower:
            if tier is store.remote:
                [chunk] = await store.remote.get_many([key])
                chunk = None if chunk is None else await store.promotion.promote(tier.name, key, chunk)
            else:
                chunk = await _read_and_promote(store, tier, [key])(0)
            if chunk is not None:
                break
    return chunk


async def _each(out: list[Chunk | None], indices: list[int], read: Callable[[int], Awaitable[Chunk | None]]) -> None:
    """``out[i] = await read(i)`` for every index, concurrently.  Every read runs to
    its end even when another fails (what it returned is in ``out``, for the
    caller to release); then the first error is raised.  If the caller is
    cancelled the reads are cancelled, and whatever they return later released."""
    if not indices:
        return
    if len(indices) == 1:
        out[indices[0]] = await read(indices[0])
        return
    tasks = {i: asyncio.ensure_future(read(i)) for i in indices}
    try:
        await asyncio.wait(tasks.values())
    except BaseException:
        for task in tasks.values():
            task.cancel()
            task.add_done_callback(_release_result)
        raise
    error: BaseException | None = None
    for i, task in tasks.items():
        if task.cancelled():
            error = error or asyncio.CancelledError()
        elif task.exception() is not None:
            error = error or task.exception()
        else:
            out[i] = task.result()
    if error is not None:
        raise error


def _release_result(task: asyncio.Future[Chunk | None]) -> None:
    if not task.cancelled() and task.exception() is None:
        chunk = task.result()
        if chunk is not None:
            chunk.release()
