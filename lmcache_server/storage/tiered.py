"""The tiered store: the batch operations the server needs, over an ordered list of tiers.

Tiers are ordered fastest first: memory, then disk, then Redis.

- Reads fall through the tiers in order; a hit below memory is *promoted*
  (copied into memory) and served from the bytes just read.
- Writes go to memory.  A chunk evicted from memory *spills* to disk through
  the disk tier's bounded write-behind queue (never blocking the request);
  every chunk stored is also queued for Redis, so other nodes see it.
- Lower tiers are inclusive: a promoted chunk stays on disk, so evicting it
  again costs no write.
- lookup/exists look at every tier without touching recency.

Batching, promotion, spill and lookup semantics are written here once, not in
each tier.  Primitives: ``get_many``, ``put_many``, ``lookup``, ``exists``,
``delete``, ``clear``, ``pin``, ``unpin``, ``stats``, ``flush``, ``close``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from lmcache_client.protocol import PutStatus

from .base import Chunk, ChunkKey, Tier
from .disk import DiskTier
from .memory import MemoryTier, Reservation
from .remote import RedisTier


@dataclasses.dataclass
class LookupCounters:
    lookups: int = 0
    chunks_asked: int = 0
    chunks_hit: int = 0


class TieredStore:
    def __init__(self, memory: MemoryTier, disk: DiskTier | None = None, remote: RedisTier | None = None):
        self.memory = memory
        self.disk = disk
        self.remote = remote
        self.lower: list[Tier] = [t for t in (disk, remote) if t is not None]
        self.tiers: list[Tier] = [memory, *self.lower]
        self.lookup_counters = LookupCounters()
        self.promotions: dict[str, int] = {t.name: 0 for t in self.lower}
        memory.on_evict = self._spill
        if disk is not None:
            memory.spill_ahead_bytes = disk.spill_ahead_bytes

    def _spill(self, key: ChunkKey, chunk: Chunk, lend: bool) -> bool:
        """An evicted chunk goes to disk: lent (written straight from the pool,
        released when written) or, when a put waits for its room, copied.
        False declines a lent chunk (the disk would drop it), so it stays in memory."""
        disk = self.disk
        if disk is None or disk.peek(key):
            chunk.release()  # nothing to write: already on disk (or queued), or no disk
            return True
        if lend:
            if not disk.accepts(chunk.nbytes):
                return False
            return disk.enqueue(key, chunk.data, chunk.release)
        disk.enqueue(key, chunk.data)
        return True

    async def get_many(self, namespace: str, digests: Sequence[bytes]) -> list[Chunk | None]:
        """One Chunk per hit (release each: memory hits are leased), None per miss."""
        out: list[Chunk | None] = []
        for digest in digests:
            key = ChunkKey(namespace, digest)
            chunk = await self.memory.get(key)
            if chunk is None and self.disk is not None:
                chunk = await self._promote_from_disk(self.disk, key)
            if chunk is None:
                for tier in self.lower:
                    chunk = await tier.get(key)
                    if chunk is not None:
                        if await self.memory.put(key, chunk.data) is PutStatus.STORED:
                            self.promotions[tier.name] += 1
                            # Serve the pool copy: leased like any memory hit
                            # (zero-copy and shared-memory replies need it there).
                            promoted = self.memory.lease(key)
                            if promoted is not None:
                                chunk.release()
                                chunk = promoted
                        break
            out.append(chunk)
        return out

    async def _promote_from_disk(self, disk: DiskTier, key: ChunkKey) -> Chunk | None:
        """Read a disk chunk straight into reserved pool memory (one copy, then a
        zero-copy send); None if it is not on disk or there is no room."""
        size = disk.payload_size(key)
        if size is None:
            return None
        reservation = self.memory.prepare_store(key, size)
        if not isinstance(reservation, Reservation):
            return self.memory.lease(key) if reservation is PutStatus.EXISTS else None
        if await disk.get(key, reservation.view) is None:
            self.memory.abort_store(reservation)
            return None
        if self.memory.complete_store(reservation) is PutStatus.STORED:
            self.promotions[disk.name] += 1
        return self.memory.lease(key)

    def reserve(self, namespace: str, digests: Sequence[bytes], sizes: Sequence[int]) -> list[Reservation | PutStatus]:
        """Phase one of a put: room in the pool for each chunk (invisible to
        readers until :meth:`commit`), or the PutStatus saying why there is none.
        A key repeated within the batch is EXISTS after its first occurrence."""
        out: list[Reservation | PutStatus] = []
        reserved: set[ChunkKey] = set()
        # Consecutive keys of one put are (nearly always) one prefix chain: the
        # previous key is a hint to the eviction policy.
        parent: ChunkKey | None = None
        for digest, size in zip(digests, sizes):
            key = ChunkKey(namespace, digest)
            if key in reserved:
                out.append(PutStatus.EXISTS)
                continue
            reservation = self.memory.prepare_store(key, size, parent)
            if isinstance(reservation, Reservation):
                reserved.add(key)
            out.append(reservation)
            parent = key
        return out

    def commit(self, reservation: Reservation) -> PutStatus:
        """Phase two: the filled reservation becomes visible, and is queued for Redis."""
        status = self.memory.complete_store(reservation)
        if self.remote is not None and status is PutStatus.STORED:
            self.remote.enqueue(reservation.key, reservation.view)
        return status

    def abort(self, reservation: Reservation) -> None:
        self.memory.abort_store(reservation)

    def prepare_puts(
        self, namespace: str, digests: Sequence[bytes], payloads: Sequence[Any]
    ) -> tuple[list[PutStatus], Callable[[], None]]:
        """A put of payload frames: the statuses to answer now, and ``finish``.

        ``finish`` copies the payloads in and makes the chunks visible.  The
        server calls it right after queueing the reply, in the same event-loop
        step, so no other request can observe the gap, while ZeroMQ's I/O
        thread already receives the client's next request: the copy into the
        pool overlaps the next transfer instead of delaying it.
        """
        sources = [memoryview(p).cast("B") for p in payloads]
        outcomes = self.reserve(namespace, digests, [src.nbytes for src in sources])
        pending = [(r, src) for r, src in zip(outcomes, sources) if isinstance(r, Reservation)]
        statuses = [PutStatus.STORED if isinstance(r, Reservation) else r for r in outcomes]

        def finish() -> None:
            for reservation, src in pending:
                reservation.view[:] = src
                self.commit(reservation)

        return statuses, finish

    async def put_many(self, namespace: str, digests: Sequence[bytes], payloads: Sequence[Any]) -> list[PutStatus]:
        """Store the chunks now (prepare_puts + finish in one step)."""
        statuses, finish = self.prepare_puts(namespace, digests, payloads)
        finish()
        return statuses

    def _where(self, key: ChunkKey) -> str | None:
        return next((t.name for t in self.tiers if t.peek(key)), None)

    async def _locate(self, namespace: str, digests: Sequence[bytes]) -> list[str | None]:
        keys = [ChunkKey(namespace, d) for d in digests]
        tiers = [self._where(k) for k in keys]
        if self.remote is not None:
            # One round trip for every key no local tier holds.
            missing = [i for i, t in enumerate(tiers) if t is None]
            found = await self.remote.exists_many([keys[i] for i in missing])
            for i, hit in zip(missing, found):
                if hit:
                    tiers[i] = self.remote.name
        return tiers

    async def lookup(self, namespace: str, digests: Sequence[bytes]) -> tuple[int, list[str | None]]:
        """Leading-hit count and the fastest tier holding each key (None: not stored)."""
        tiers = await self._locate(namespace, digests)
        hits = next((i for i, t in enumerate(tiers) if t is None), len(tiers))
        c = self.lookup_counters
        c.lookups += 1
        c.chunks_asked += len(digests)
        c.chunks_hit += hits
        return hits, tiers

    async def exists(self, namespace: str, digests: Sequence[bytes]) -> list[bool]:
        return [t is not None for t in await self._locate(namespace, digests)]

    async def delete(self, namespace: str, digests: Sequence[bytes]) -> list[bool]:
        out = []
        for digest in digests:
            key = ChunkKey(namespace, digest)
            out.append(any([await t.delete(key) for t in self.tiers]))
        return out

    async def clear(self, namespace: str | None) -> int:
        """Chunks removed (a chunk in two local tiers counts once; Redis keys count
        when no local tier held them)."""
        keys: set[ChunkKey] = set()
        for tier in self.tiers:
            keys.update(_keys_of(tier, namespace))
        remote_removed = 0
        for tier in self.tiers:
            removed = await tier.clear(namespace)
            if tier is self.remote:
                remote_removed = removed
        return max(len(keys), remote_removed)

    def pin(self, namespace: str, digests: Sequence[bytes]) -> list[bool]:
        return [self.memory.pin(ChunkKey(namespace, d)) for d in digests]

    def unpin(self, namespace: str, digests: Sequence[bytes]) -> list[bool]:
        return [self.memory.unpin(ChunkKey(namespace, d)) for d in digests]

    def stats(self, namespace: str | None = None) -> dict[str, Any]:
        c = self.lookup_counters
        tiers = {t.name: t.stats() for t in self.tiers}
        for name, count in self.promotions.items():
            tiers[name]["promotions"] = count
        out: dict[str, Any] = {
            "tiers": tiers,
            "lookups": c.lookups,
            "lookup_chunks": c.chunks_asked,
            "lookup_hit_chunks": c.chunks_hit,
            "lookup_hit_rate": round(c.chunks_hit / c.chunks_asked, 4) if c.chunks_asked else 0.0,
        }
        per_tier = {t.name: t.namespaces() for t in self.tiers}
        if namespace is not None:
            out["namespace"] = {"name": namespace, **_namespace_stats(per_tier, namespace)}
        else:
            names = sorted({ns for counts in per_tier.values() for ns in counts})
            out["namespaces"] = {ns: _namespace_stats(per_tier, ns) for ns in names}
        return out

    async def flush(self, timeout_s: float) -> bool:
        """Let write-behind queues drain (shutdown); True if everything was written."""
        deadline = time.monotonic() + timeout_s
        done = True
        for tier in (self.remote, self.disk):
            if tier is not None:
                done = await tier.flush(max(0.0, deadline - time.monotonic())) and done
        return done

    async def close(self) -> None:
        # Lowest first: their writers may still be reading pool memory (lent spills).
        for tier in reversed(self.tiers):
            await tier.close()


def _keys_of(tier: Tier, namespace: str | None) -> list[ChunkKey]:
    return [k for k in tier.keys() if namespace is None or k.namespace == namespace]  # noqa: SIM118 - a Tier is no dict


def _namespace_stats(per_tier: dict[str, dict[str, tuple[int, int]]], namespace: str) -> dict[str, Any]:
    memory_chunks, memory_bytes = per_tier.get("memory", {}).get(namespace, (0, 0))
    out: dict[str, Any] = {"chunks": memory_chunks, "stored_bytes": memory_bytes}
    for tier, counts in per_tier.items():
        if tier != "memory":
            chunks, nbytes = counts.get(namespace, (0, 0))
            out[f"{tier}_chunks"] = chunks
            out[f"{tier}_stored_bytes"] = nbytes
    return out
