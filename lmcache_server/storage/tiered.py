"""The tiered store: the batch operations the server needs, over an ordered list of tiers.

Tiers are ordered fastest first: memory, then disk, then Redis.

- Reads fall through the tiers in order; a hit below memory is *promoted*
  (copied into memory) and served from the bytes just read.  A batch reads
  each lower tier for all its keys at once: the disk files concurrently, Redis
  in one round trip (:mod:`.batchread`).
- Writes go to memory.  A chunk evicted from memory *spills* to disk through
  the disk tier's bounded write-behind queue (never blocking the request);
  every chunk stored is also queued for Redis, so other nodes see it.
- Multi-MiB copies (a put's payload into the pool, a promotion from Redis)
  run off the event loop (:mod:`.offload`).  A put is answered as soon as its
  room is reserved; its chunks are *filling* until copied, and every read,
  lookup, delete or pin of a filling chunk waits for (or counts) the fill, so a
  client that was answered STORED always sees its chunk (:mod:`.filling`).
- Reservations are never leaked: a read that fails or is cancelled gives its
  room back, and a cancelled one only once the thread writing into that room
  has finished; leases taken for a batch are released if the batch fails.
- Admission (optional, :mod:`.tieradmission`): the disk and Redis may take only
  chunks likely to be read again; memory takes every put.  The spill asks it
  (a declined chunk is dropped when evicted); Redis is asked when a chunk is
  stored and again when it is read or put again.
- Lower tiers are inclusive: a promoted chunk stays on disk, so evicting it
  again costs no write.
- lookup/exists look at every tier without touching recency.
- Sizing telemetry (optional, :mod:`.sizing`): lookups and the memory pass of
  gets are recorded in its windows (the hit rate an unbounded memory tier would
  have had, beside the actual one).
- KV events (:class:`.base.Residency`, optional): a put that carries token ids
  is announced when it becomes readable; a chunk that leaves the last local
  tier (memory, disk) is announced as removed (as moved to Redis, locality
  REMOTE, when Redis is known to hold it); a clear, as cleared.  An
  announced chunk's records below memory carry its token ids, so that a chunk
  promoted from Redis (this node's or another's) is announced too.

Batching, promotion, spill and lookup semantics are written here once, not in
each tier.  This module holds :class:`TieredStore`'s composition, reads and
promotion, spill, removals, stats and lifecycle; it builds on
:class:`.tieredputs.TieredPuts` (the two-phase put, its variants, the uplink to
Redis), :class:`.tieredlookup.TieredLookup` (lookup and exists) and
:class:`.tieredpromote.TieredPromotion` (the copies into memory that reads and
prefetches share, and the prefetch of a lookup's lower-tier chunks).

Primitives: ``get_many``, ``prepare_puts``, ``put_many``, ``reserve``, ``commit``, ``abort``,
``stage``, ``bind``, ``lookup``, ``exists``, ``prefetch_sizes``, ``prefetch``, ``delete``, ``clear``,
``pin``, ``unpin``, ``stats``, ``flush``, ``close``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from lmcache_client.keys import ChunkTokens
from lmcache_client.protocol import PutStatus

from ..supervisor import Supervisor
from .base import Chunk, ChunkKey, Residency, Tier
from .batchread import read_batch
from .disk import DiskTier
from .filling import Filling
from .memory import MemoryTier
from .offload import Offload
from .remote import RedisTier
from .sizing import Sizing
from .tieradmission import StoreAdmission
from .tieredlookup import LookupCounters, TieredLookup
from .tieredpromote import TieredPromotion
from .tieredputs import ROOM_WAIT_S as ROOM_WAIT_S  # re-exported: server/shm.py reads it
from .tieredputs import TieredPuts


class TieredStore(TieredPuts, TieredLookup, TieredPromotion):
    def __init__(
        self,
        memory: MemoryTier,
        disk: DiskTier | None = None,
        remote: RedisTier | None = None,
        *,
        offload: Offload | None = None,
        supervisor: Supervisor | None = None,
        admission: StoreAdmission | None = None,
    ):
        self.memory = memory
        self.disk = disk
        self.remote = remote
        self.offload = offload if offload is not None else Offload()
        self._own_offload = offload is None
        self.supervisor = supervisor if supervisor is not None else Supervisor()
        self.filling = Filling(memory, self.offload, self.commit, self.supervisor)
        """Chunks answered STORED whose bytes are still being copied into the pool."""
        self.lower: list[Tier] = [t for t in (disk, remote) if t is not None]
        self.tiers: list[Tier] = [memory, *self.lower]
        self.lookup_counters = LookupCounters()
        self.promotions: dict[str, int] = {t.name: 0 for t in self.lower}
        self.admission = admission
        """Which chunks the disk and Redis take (:mod:`.tieradmission`); None: every chunk."""
        memory.on_evict = self._spill
        self.events: Residency | None = None
        """Told what becomes readable and what leaves (the KV-event announcer); set by the composition root."""
        self.sizing: Sizing | None = None
        """Sizing telemetry (:mod:`.sizing`): lookups and gets recorded in its windows; set by the composition root."""
        self.record_tokens = True
        """Write announced chunks' token ids into their disk and Redis records (``record_tokens``)."""
        memory.on_removed = self._left_memory
        for tier in (disk, remote):
            if tier is not None:
                tier.tokens_of = self._tokens_of
        if disk is not None:
            disk.on_removed = self._left
        if disk is not None:
            memory.spill_ahead_bytes = disk.spill_ahead_bytes
            memory.lends_spills = True

    def _spill(self, key: ChunkKey, chunk: Chunk, lend: bool) -> bool:
        """An evicted chunk goes to disk: lent (written straight from the pool,
        released when written) or, when a put waits for its room, copied.
        False declines a lent chunk (the disk would drop it, or admission does not
        take it yet), so it stays in memory; a chunk admission declines when a put
        needs its room is dropped (counted)."""
        disk = self.disk
        admission = self.admission
        if disk is None or disk.peek(key):
            chunk.release()  # nothing to write: already on disk (or queued), or no disk
            if admission is not None:
                admission.evicted(key)
            return True
        if lend and not disk.accepts(chunk.nbytes):
            return False
        if admission is not None:
            if not admission.spill(key, chunk.nbytes, lambda: disk.victim_for(chunk.nbytes), final=not lend):
                if lend:
                    return False
                chunk.release()
                admission.evicted(key)
                return True
            admission.evicted(key)
        if lend:
            return disk.enqueue(key, chunk.data, chunk.release)
        disk.enqueue(key, chunk.data)
        return True

    def _tokens_of(self, key: ChunkKey) -> ChunkTokens | None:
        """The token ids a record of ``key`` carries (:mod:`.chunkfile`): those of an
        announced chunk, when ``record_tokens`` is on."""
        if self.events is None or not self.record_tokens:
            return None
        return self.events.tokens(key)

    def _left_memory(self, key: ChunkKey) -> None:
        if self.admission is not None:
            self.admission.removed(key)
        self._left(key)

    def _left(self, key: ChunkKey) -> None:
        """A tier dropped ``key``: announce it removed once no local tier holds it (moved
        to Redis when Redis is known to hold it), else where it now is (its medium
        changes when it leaves memory for the disk)."""
        if self.events is not None and self.events.announced(key):
            where = self._where(key)
            if where is None and self.remote is not None and self.events.remote_holds(key):
                where = self.remote.name
            if where is None:
                self.events.removed(key)
            else:
                self.events.moved(key, where)

    async def get_many(self, namespace: str, digests: Sequence[bytes]) -> list[Chunk | None]:
        """One Chunk per hit (release each: memory hits are leased), None per miss,
        in the order asked.  Each lower tier is read for the whole batch at once:
        disk reads run concurrently (up to the disk's I/O threads), Redis is one
        round trip (:mod:`.batchread`).  If a tier read fails, the leases already
        taken are released before the error propagates."""
        keys = [ChunkKey(namespace, d) for d in digests]
        chunks = await read_batch(self, keys)
        if self.admission is not None:
            for key, chunk in zip(keys, chunks):
                if chunk is not None:
                    self._accessed(key)
        return chunks

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

    async def promote_from_disk(self, disk: DiskTier, key: ChunkKey) -> Chunk | None:
        """Read a disk chunk straight into reserved pool memory (one copy, then a
        zero-copy send); None if it is not on disk or there is no room."""
        status = await self.fill_from_disk(disk, key)
        if status is not None and status not in (PutStatus.STORED, PutStatus.EXISTS):
            return None  # no room
        return self.memory.lease(key)  # None: not on disk, or its read failed

    async def delete(self, namespace: str, digests: Sequence[bytes]) -> list[bool]:
        out = []
        for digest in digests:
            key = ChunkKey(namespace, digest)
            await self.filling.filled(key)
            if self.remote is not None and self.remote.listener is not None:
                self.remote.listener.gone([key])  # first: leaving memory now is no move to Redis
            # Memory first, as ever: a read meanwhile cannot queue the chunk for Redis again
            # after its Redis delete (it would come back there).
            out.append(any([await t.delete(key) for t in self.tiers]))
            if self.admission is not None:
                self.admission.deleted(key)
        return out

    async def clear(self, namespace: str | None) -> int:
        """Chunks removed (a chunk in two local tiers counts once; Redis keys count
        when no local tier held them)."""
        await self.filling.settled(namespace)
        if self.events is not None:
            self.events.cleared(namespace)
        keys: set[ChunkKey] = set()
        for tier in self.tiers:
            keys.update(_keys_of(tier, namespace))
        remote_removed = 0
        for tier in self.tiers:
            removed = await tier.clear(namespace)
            if tier is self.remote:
                remote_removed = removed
        if self.admission is not None:
            self.admission.cleared(namespace)  # that namespace's keys only
        return max(len(keys), remote_removed)

    async def pin(self, namespace: str, digests: Sequence[bytes]) -> list[bool]:
        keys = [ChunkKey(namespace, d) for d in digests]
        for key in keys:
            await self.filling.filled(key)
        return [self.memory.pin(key) for key in keys]

    async def unpin(self, namespace: str, digests: Sequence[bytes]) -> list[bool]:
        keys = [ChunkKey(namespace, d) for d in digests]
        for key in keys:
            await self.filling.filled(key)
        return [self.memory.unpin(key) for key in keys]

    def stats(self, namespace: str | None = None) -> dict[str, Any]:
        c = self.lookup_counters
        tiers = {t.name: t.stats() for t in self.tiers}
        for name, count in self.promotions.items():
            tiers[name]["promotions"] = count
        if self.admission is not None:
            for name, counts in self.admission.stats().items():
                if name in tiers:
                    tiers[name].update(counts)
        out: dict[str, Any] = {
            "tiers": tiers,
            "lookups": c.lookups,
            "lookup_chunks": c.chunks_asked,
            "lookup_hit_chunks": c.chunks_hit,
            "lookup_hit_rate": round(c.chunks_hit / c.chunks_asked, 4) if c.chunks_asked else 0.0,
        }
        if self.events is not None:
            out["events"] = self.events.stats()
        # Redis keeps no per-namespace index (a count would be a SCAN of a shared
        # server): its namespace figures are left out rather than shown as 0.
        per_tier = {t.name: t.namespaces() for t in self.tiers if t is not self.remote}
        if namespace is not None:
            out["namespace"] = {"name": namespace, **self._namespace_stats(per_tier, namespace)}
        else:
            names = sorted({ns for counts in per_tier.values() for ns in counts})
            out["namespaces"] = {ns: self._namespace_stats(per_tier, ns) for ns in names}
        return out

    def _namespace_stats(self, per_tier: dict[str, dict[str, tuple[int, int]]], namespace: str) -> dict[str, Any]:
        """One namespace's chunks and bytes per tier, and its pinned chunks and bytes."""
        out = _namespace_stats(per_tier, namespace)
        out["pinned_chunks"], out["pinned_bytes"] = self.memory.pinned_in(namespace)
        return out

    async def flush(self, timeout_s: float) -> bool:
        """Let fills and write-behind queues drain (shutdown); True if everything was written."""
        deadline = time.monotonic() + timeout_s
        done = await self.filling.wait(timeout_s)
        for tier in (self.remote, self.disk):
            if tier is not None:
                done = await tier.flush(max(0.0, deadline - time.monotonic())) and done
        return done

    async def close(self) -> None:
        # Fills write into the pool from a thread: let them end (milliseconds) first.
        await self.filling.wait()
        # Lowest first: their writers may still be reading pool memory (lent spills).
        for tier in reversed(self.tiers):
            await tier.close()
        if self._own_offload:
            self.offload.close()


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
