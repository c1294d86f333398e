"""The remote tier's writes (:class:`RemoteWriter`, a part :class:`.tier.RemoteTier`
builds and holds): write-behind, batched, on the tier's link (:class:`.links.RemoteLink`:
Redis or Mooncake).

- ``enqueue`` queues a chunk (:class:`.queue.WriteQueue`, bounded by bytes;
  full -> dropped and counted) and builds its record (checksum and copy, with
  the chunk's token ids when the store knows them, ``links``) off the event loop
  (:mod:`..offload`); a request never waits.  On a link that sends from the pool
  (``link.from_pool``: Mooncake) only the header is built (the checksum, no copy)
  and the write keeps the pool's lease until it leaves the queue.
- One background task (``write_loop``) first sends the removals Redis is owed,
  then the queued writes in pipelines of at most ``BATCH_WRITES`` writes and
  ``batch_bytes`` bytes, sized to what the link sends within half of
  ``timeout_s``.  A write leaves the queue only once the store acknowledged it; a
  failure of the store marks the link down and the writes wait for it; a batch
  that timed out is halved, not an outage; a write the store has no room for now
  (Mooncake's pool is full until it evicts, or a segment is being remounted) waits
  and is tried again; a write that keeps failing with an unexpected error or for
  lack of room is dropped after ``POISON_FAILURES`` tries.

Primitives: :class:`RemoteWriter` (``accepts``, ``enqueue``, ``put``, ``write_loop``, ``idle``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from lmcache_client.keys import ChunkTokens
from lmcache_client.protocol import PutStatus

from ..base import ChunkKey, RemoteListener, TierLinks
from ..chunkfile import encode_header, encode_record
from ..offload import Offload
from .links import RemoteLink
from .queue import Write, WriteQueue

logger = logging.getLogger("lmcache_server.storage.remote.tier")  # the tier's log lines keep their logger name

POISON_FAILURES = 3
"""A queued write that fails this many times with an unexpected error (or for lack of room) is dropped (counted)."""
BATCH_WRITES, BATCH_BYTES = 64, 32 << 20
"""At most this many writes (and, past the first, bytes) per round trip to the store."""
NO_ROOM_WAIT_S = 0.2
"""How long the writer waits, per failure, after the store had no room for a write."""


class RemoteWriter:
    """The writes of :class:`.tier.RemoteTier`: queued in ``queue``, records built on
    ``offload`` (with the token ids ``links`` gives, KV events), sent over ``link``;
    ``listener`` gives who is told what the store acknowledged (None: nobody, e.g. once
    the tier stopped)."""

    def __init__(
        self,
        link: RemoteLink,
        queue: WriteQueue,
        offload: Offload,
        links: TierLinks,
        listener: Callable[[], RemoteListener | None],
        *,
        ttl_ms: int | None,
    ):
        self._link = link
        self.queue = queue
        self._offload = offload
        self.links = links
        self._listener = listener
        self.ttl_ms = ttl_ms
        self.batch_bytes = BATCH_BYTES  # bytes of writes per batch: what the link sends within timeout_s / 2
        self.building: set[asyncio.Task[None]] = set()  # records being built off the loop
        self.writing: list[Write] | None = None  # the batch being sent
        self.removing = 0  # removals taken from the queue and not yet acknowledged by Redis

    def idle(self) -> bool:
        """Nothing being built, sent or removed (the queue may still hold writes)."""
        return self.writing is None and not self.building and not self.removing

    # -- writes --------------------------------------------------------------------
    def accepts(self, size: int) -> bool:
        return self.queue.fits(size)

    def enqueue(self, key: ChunkKey, data: Any, release: Callable[[], None] | None = None) -> bool:
        """Queue a chunk for the store; False (counted) if the queue is full.

        The record is built off the event loop from ``data``, which must stay
        unchanged until ``release()`` is called (once, when it has been copied
        or the write is dropped); without ``release`` the bytes must never change.
        """
        size = memoryview(data).nbytes
        if not self.queue.fits(size):
            self._link.state.counters.dropped_writes += 1
            if release is not None:
                release()
            return False
        from_pool = self._link.from_pool and release is not None and not memoryview(data).readonly
        write = self.queue.add(key, size, release if from_pool else None)
        if write is None:  # already queued
            if release is not None:
                release()
            return True
        tokens = self.links.tokens_of(key)
        write.building = True
        if from_pool:
            build = self._build_header(write, memoryview(data).cast("B"), tokens)
        else:
            build = self._build(write, data, release, tokens)
        task = asyncio.get_running_loop().create_task(build)
        self.building.add(task)
        task.add_done_callback(self.building.discard)
        return True

    async def _build(
        self, write: Write, data: Any, release: Callable[[], None] | None, tokens: ChunkTokens | None
    ) -> None:
        try:
            record = await self._offload.run(encode_record, write.key.namespace, write.key.digest, data, tokens)
        except Exception as err:
            logger.warning("%s: cannot build the record of a chunk (%s); not written", self._link.label, err)
            self._link.state.counters.dropped_writes += 1
            write.building = False
            self.queue.done(write)
            return
        finally:
            if release is not None:
                release()
        if self.queue.built(write, record):
            self._link.state.wake.set()

    async def _build_header(self, write: Write, payload: memoryview, tokens: ChunkTokens | None) -> None:
        """The header of a write sent from the pool (its checksum, off the loop); the
        payload stays in the pool, leased, until the write leaves the queue."""
        try:
            header = await self._offload.run(encode_header, write.key.namespace, write.key.digest, payload, 0, tokens)
        except asyncio.CancelledError:  # the tier stops
            self.queue.abandoned(write)
            raise
        except Exception as err:
            logger.warning("%s: cannot build the header of a chunk (%s); not written", self._link.label, err)
            self._link.state.counters.dropped_writes += 1
            write.building = False
            self.queue.done(write)
            return
        if self.queue.built(write, (header, payload)):  # the link copies the header where it sends it from
            self._link.state.wake.set()

    async def write_loop(self) -> None:
        while True:
            if not self._link.state.up or (self.queue.head() is None and not self.queue.pending_removals):
                self._link.state.wake.clear()
                await self._link.state.wake.wait()
                continue
            batch: list[Write] = []
            try:
                await self._send_removals()
                batch = self.queue.heads(BATCH_WRITES, self.batch_bytes)
                if batch:
                    started = time.monotonic()
                    refused = await self._send(batch)
                    self._fit_batches(sum(w.size for w in batch), time.monotonic() - started)
                    if refused:  # no room in the store now: wait a little before trying them again
                        await asyncio.sleep(NO_ROOM_WAIT_S * max(w.failures for w in refused))
            except self._link.errors as err:
                self._link.state.counters.write_errors += 1
                if isinstance(err, self._link.timeouts) and len(batch) > 1:  # too big for the link in time
                    sent = sum(w.size for w in batch)
                    self.batch_bytes = max(1, sent // 2)
                    logger.info("%s: a batch of %d writes (%.1f MiB) timed out; sending at most %.1f MiB a batch",
                                self._link.label, len(batch), sent / 2**20, self.batch_bytes / 2**20)  # fmt: skip
                    continue
                self._link.state.mark_down(err)  # the writes stay queued: sent again once the store is back
            except Exception:
                # Not a Redis failure: a bug or a reply nothing expects.  The
                # supervisor logs, counts and restarts the loop; a write that
                # keeps failing so is dropped rather than blocking the queue.
                for write in batch:
                    write.failures += 1
                    if write.failures >= POISON_FAILURES:
                        self.queue.done(write)
                        self._link.state.counters.dropped_writes += 1
                raise

    def _fit_batches(self, sent: int, elapsed_s: float) -> None:
        """Size the next batches to what the link sent lately within half the timeout
        (a whole batch is bounded by ``timeout_s``): a slow link gets smaller batches
        instead of timeouts, a fast one BATCH_BYTES."""
        rate = sent / max(elapsed_s, 1e-6)
        self.batch_bytes = int(min(BATCH_BYTES, max(1, rate * self._link.timeout_s / 2, self.batch_bytes // 2)))

    async def _send(self, batch: list[Write]) -> list[Write]:
        """Write a batch in one round trip; the writes leave the queue only once the store
        acknowledged them (a write is idempotent: a batch that failed half-way is sent
        again whole).  What the store had no room for stays queued (returned; dropped,
        counted, after ``POISON_FAILURES`` tries)."""
        self.writing = batch
        sent_at = time.monotonic()
        for write in batch:
            write.attempted = True
        try:
            stored = await self._link.write([(w.key, w.record) for w in batch], self.ttl_ms)  # all built (heads)
        finally:
            self.writing = None
            self._link.state.counters.timed("write", sent_at)
        refused: list[Write] = []
        for write, ok in zip(batch, stored):
            if ok:
                self._link.state.counters.stores += 1
                self.queue.done(write)  # if it was deleted meanwhile, its pending delete follows
                continue
            write.failures += 1
            if write.failures >= POISON_FAILURES:
                self.queue.done(write)
                self._link.state.counters.dropped_writes += 1
            else:
                refused.append(write)
        listener = self._listener()  # (none once the tier stopped)
        if listener is not None and self._link.state.up:  # the store holds them now (unless deleted meanwhile)
            listener.written([w.key for w, ok in zip(batch, stored) if ok and not w.cancelled], sent_at)
        return refused

    async def _send_removals(self) -> None:
        clears, deletes = self.queue.take_removals()
        self.removing = len(clears) + len(deletes)
        try:
            for namespace in list(clears):
                await self._link.clear(namespace)
                clears.remove(namespace)
            while deletes:
                batch = deletes[-500:]
                await self._link.remove(batch)
                del deletes[-len(batch) :]
        except BaseException:
            self.queue.put_back(clears, deletes)
            raise
        finally:
            self.removing = 0

    async def put(self, key: ChunkKey, data: Any, parent: ChunkKey | None = None) -> PutStatus:
        return PutStatus.STORED if self.enqueue(key, bytes(data)) else PutStatus.NO_SPACE
