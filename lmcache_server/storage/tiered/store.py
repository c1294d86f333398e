"""The tiered store: the batch operations the server needs, over an ordered list of tiers.

Tiers are ordered fastest first: memory, then disk, then Redis.

- Reads fall through the tiers in order; a hit below memory is *promoted*
  (copied into memory) and served from the bytes just read.  A batch reads
  each lower tier for all its keys at once: the disk files concurrently, Redis
  in one round trip (:mod:`.reads`).
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
- The tier gate (optional, :mod:`.gate`): the disk and Redis may take only
  chunks likely to be read again; memory takes every put.  The spill asks it
  (a chunk it stops is dropped when evicted); Redis's gate is asked when a chunk
  is stored and again when it is read or put again.
- Lower tiers are inclusive: a promoted chunk stays on disk, so evicting it
  again costs no write.
- lookup/exists look at every tier without touching recency.
- Sizing telemetry (optional, :mod:`..sizing`): lookups and the memory pass of
  gets are recorded in its windows (the hit rate an unbounded memory tier would
  have had, beside the actual one).
- KV events (:class:`..base.Residency`, optional): a put that carries token ids
  is announced when it becomes readable; a chunk that leaves the last local
  tier (memory, disk) is announced as removed (as moved to Redis, locality
  REMOTE, when Redis is known to hold it); a clear, as cleared.  An
  announced chunk's records below memory carry its token ids, so that a chunk
  promoted from Redis (this node's or another's) is announced too.

Batching, promotion, spill and lookup semantics are written here once, not in
each tier.  The store holds its tiers by the roles they play (:mod:`.roles`:
memory, a spill target, an uplink) and is a facade over its parts, each in its
module:

- writes (:class:`.writes.Writes`): the two-phase put and its variants; the
  commit (:class:`.writes.Commit`), shared with the fills of answered puts
  (:class:`.filling.Filling`);
- reads (:class:`.reads.Reads`): ``get_many``, each lower tier read for the
  whole batch at once;
- lookups (:class:`.lookups.Lookups`): ``lookup``, ``exists``, ``where``;
- promotion and prefetch (:class:`.promotion.Promotion`): the copies into memory;
- the uplink (:class:`.uplink.Uplinking`): what is stored, queued for Redis;
- the spill (:class:`.spill.Spill`): what memory evicts, to the disk;
- residence (:class:`.residence.Residence`): what the KV-event announcer and the
  gate are told as chunks arrive in and leave the tiers;
- upkeep (:class:`.upkeep.Upkeep`): delete, clear, pin, unpin; figures
  (:class:`.stats.StoreStats`).

Primitives: ``get_many``, ``prepare_puts``, ``put_many``, ``reserve``, ``commit``, ``abort``,
``stage``, ``bind``, ``lookup``, ``exists``, ``prefetch_sizes``, ``prefetch``, ``delete``, ``clear``,
``pin``, ``unpin``, ``stats``, ``flush``, ``close``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from lmcache_client.keys import ChunkTokens
from lmcache_client.protocol import PutStatus

from ...supervisor import Supervisor
from ..base import Chunk, ChunkKey, Residency, TierLinks
from ..memory import Reservation
from ..offload import Offload
from ..sizing import Sizing
from .filling import Filling
from .gate import StoreGate
from .lookups import Lookups
from .promotion import Promotion
from .reads import Reads
from .residence import Residence
from .roles import Memory, SpillTarget, Tiers, Uplink
from .spill import Spill, StoreListener
from .stats import StoreStats
from .upkeep import Upkeep
from .uplink import Uplinking
from .writes import Commit, Writes


class TieredStore:
    """``gate``: which chunks the disk and Redis take (:mod:`.gate`; None: every chunk).
    ``events``: told what becomes readable and what leaves (the KV-event announcer).
    ``sizing``: lookups and gets recorded in its windows (:mod:`..sizing`).
    ``record_tokens``: write announced chunks' token ids into their disk and Redis
    records.  ``links``: the line the tiers were built with (:class:`..base.TierLinks`):
    the store listens on it for memory's victims (the spill), the tiers' removals and
    the records' token ids; None: tiers built without one (nothing spills, nothing is
    told)."""

    def __init__(
        self,
        memory: Memory,
        disk: SpillTarget | None = None,
        remote: Uplink | None = None,
        *,
        offload: Offload | None = None,
        supervisor: Supervisor | None = None,
        gate: StoreGate | None = None,
        events: Residency | None = None,
        sizing: Sizing | None = None,
        record_tokens: bool = True,
        links: TierLinks | None = None,
    ):
        tiers = Tiers(memory, disk, remote)
        self.memory = memory
        self.disk = disk
        self.remote = remote
        self.tiers = tiers.all
        self.lower = tiers.lower
        self.offload = offload if offload is not None else Offload()
        self._own_offload = offload is None
        self.supervisor = supervisor if supervisor is not None else Supervisor()
        self.gate = gate
        self.events = events
        self.sizing = sizing
        self._uplinking = Uplinking(memory, remote, gate)
        self._lookups: Lookups  # (built below: residence asks it where a chunk is)
        self._residence = Residence(events, record_tokens, gate, self.where, remote.name if remote else None)
        commit = Commit(memory, self._residence, self._uplinking)
        self.filling = Filling(memory, self.offload, commit, self.supervisor)
        """Chunks answered STORED whose bytes are still being copied into the pool."""
        self._lookups = Lookups(tiers, self.filling, sizing)
        self._writes = Writes(memory, self.filling, commit, self._residence, self._uplinking, gate)
        self._promotion = Promotion(tiers, self.filling, self.offload, self._residence, gate)
        accessed = self._writes.accessed if gate is not None else None
        self._reads = Reads(tiers, self.filling, self._promotion, sizing, accessed)
        self._upkeep = Upkeep(tiers, self.filling, gate, events)
        self._stats = StoreStats(tiers, self._lookups.counters, self._promotion.counts, gate, events)
        self.lookup_counters = self._lookups.counters
        self.promotions = self._promotion.counts
        self._spill = Spill(disk, gate)
        if links is not None:
            links.listen(StoreListener(self._spill, self._residence))

    # -- writes (.writes) ----------------------------------------------------------------
    def reserve(
        self,
        namespace: str,
        digests: Sequence[bytes],
        sizes: Sequence[int],
        tokens: Sequence[ChunkTokens | None] | None = None,
    ) -> list[Reservation | PutStatus]:
        return self._writes.reserve(namespace, digests, sizes, tokens)

    async def reserve_waiting(
        self,
        namespace: str,
        digests: Sequence[bytes],
        sizes: Sequence[int],
        tokens: Sequence[ChunkTokens | None] | None = None,
    ) -> list[Reservation | PutStatus]:
        return await self._writes.reserve_waiting(namespace, digests, sizes, tokens)

    def stage(self, sizes: Sequence[int]) -> list[Reservation] | None:
        return self._writes.stage(sizes)

    def bind(
        self,
        namespace: str,
        digests: Sequence[bytes],
        rooms: Sequence[Reservation],
        tokens: Sequence[ChunkTokens | None] | None = None,
        taken: list[Reservation] | None = None,
    ) -> list[PutStatus]:
        return self._writes.bind(namespace, digests, rooms, tokens, taken)

    def commit(self, reservation: Reservation) -> PutStatus:
        return self._writes.commit(reservation)

    def abort(self, reservation: Reservation) -> None:
        self._writes.abort(reservation)

    async def prepare_puts(
        self,
        namespace: str,
        digests: Sequence[bytes],
        payloads: Sequence[Any],
        tokens: Sequence[ChunkTokens | None] | None = None,
    ) -> tuple[list[PutStatus], Callable[[], asyncio.Future[None] | None]]:
        return await self._writes.prepare_puts(namespace, digests, payloads, tokens)

    async def put_many(
        self,
        namespace: str,
        digests: Sequence[bytes],
        payloads: Sequence[Any],
        tokens: Sequence[ChunkTokens | None] | None = None,
    ) -> list[PutStatus]:
        return await self._writes.put_many(namespace, digests, payloads, tokens)

    def uplink_again(self, key: ChunkKey) -> bool:
        return self._uplinking.again(key)

    # -- reads (.reads) and promotion (.promotion) -----------------------------------------
    async def get_many(self, namespace: str, digests: Sequence[bytes]) -> list[Chunk | None]:
        return await self._reads.get_many(namespace, digests)

    async def promote(self, tier: str, key: ChunkKey, chunk: Chunk) -> Chunk:
        return await self._promotion.promote(tier, key, chunk)

    async def promote_from_disk(self, disk: SpillTarget, key: ChunkKey) -> Chunk | None:
        return await self._promotion.promote_from_disk(disk, key)

    async def prefetch_sizes(self, keys: Sequence[ChunkKey]) -> dict[ChunkKey, int]:
        return await self._promotion.prefetch_sizes(keys)

    async def prefetch(self, keys: Sequence[ChunkKey]) -> list[int]:
        return await self._promotion.prefetch(keys)

    # -- lookups (.lookups) ------------------------------------------------------------------
    def where(self, key: ChunkKey) -> str | None:
        return self._lookups.where(key)

    async def lookup(self, namespace: str, digests: Sequence[bytes]) -> tuple[int, list[str | None]]:
        return await self._lookups.lookup(namespace, digests)

    def lookup_now(self, namespace: str, digests: Sequence[bytes]) -> tuple[int, list[str | None]] | None:
        return self._lookups.lookup_now(namespace, digests)

    async def exists(self, namespace: str, digests: Sequence[bytes]) -> list[bool]:
        return await self._lookups.exists(namespace, digests)

    # -- upkeep (.upkeep) and figures (.stats) ---------------------------------------------
    async def delete(self, namespace: str, digests: Sequence[bytes]) -> list[bool]:
        return await self._upkeep.delete(namespace, digests)

    async def clear(self, namespace: str | None) -> int:
        return await self._upkeep.clear(namespace)

    async def pin(self, namespace: str, digests: Sequence[bytes]) -> list[bool]:
        return await self._upkeep.pin(namespace, digests)

    async def unpin(self, namespace: str, digests: Sequence[bytes]) -> list[bool]:
        return await self._upkeep.unpin(namespace, digests)

    def stats(self, namespace: str | None = None) -> dict[str, Any]:
        return self._stats.stats(namespace)

    # -- lifecycle -------------------------------------------------------------------------
    async def flush(self, timeout_s: float) -> bool:
        """Let fills and write-behind queues drain (shutdown); True if everything was written."""
        deadline = time.monotonic() + timeout_s
        done = await self.filling.wait(timeout_s)
        for tier in (self.remote, self.disk):
            if tier is not None:
                done = await tier.flush(max(0.0, deadline - time.monotonic())) and done
        return done

    async def close(self, keep_segment: bool = False) -> None:
        """Close every tier; with ``keep_segment`` the memory tier leaves its shared pool
        segment in place (a warm restart: its index was written, storage/memory/warmstart.py)."""
        # Fills write into the pool from a thread: let them end (milliseconds) first.
        await self.filling.wait()
        # Lowest first, memory last: their writers may still be reading pool memory (lent spills).
        for tier in reversed(self.tiers[1:]):
            await tier.close()
        await self.memory.close(keep_segment=keep_segment)
        if self._own_offload:
            self.offload.close()
