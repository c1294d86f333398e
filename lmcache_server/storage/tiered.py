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
- Lower tiers are inclusive: a promoted chunk stays on disk, so evicting it
  again costs no write.
- lookup/exists look at every tier without touching recency.
- KV events (:class:`.base.Residency`, optional): a put that carries token ids
  is announced when it becomes readable; a chunk that leaves the last local
  tier (memory, disk) is announced as removed; a clear, as cleared.

Batching, promotion, spill and lookup semantics are written here once, not in
each tier.  Primitives: ``get_many``, ``prepare_puts``, ``put_many``,
``reserve``, ``commit``, ``abort``, ``stage``, ``bind``, ``lookup``, ``exists``, ``delete``,
``clear``, ``pin``, ``unpin``, ``stats``, ``flush``, ``close``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from lmcache_client.keys import ChunkTokens
from lmcache_client.protocol import PutStatus

from ..supervisor import Supervisor
from .base import Chunk, ChunkKey, Residency, Tier
from .batchread import read_batch
from .disk import DiskTier
from .filling import Filling, fill_reservation
from .memory import MemoryTier, Reservation
from .offload import Offload
from .remote import RedisTier

ROOM_WAIT_S = 5.0
"""How long a put waits for room that spills being written will free."""


@dataclasses.dataclass
class LookupCounters:
    lookups: int = 0
    chunks_asked: int = 0
    chunks_hit: int = 0


class TieredStore:
    def __init__(
        self,
        memory: MemoryTier,
        disk: DiskTier | None = None,
        remote: RedisTier | None = None,
        *,
        offload: Offload | None = None,
        supervisor: Supervisor | None = None,
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
        memory.on_evict = self._spill
        self.events: Residency | None = None
        """Told what becomes readable and what leaves (the KV-event announcer); set by the composition root."""
        memory.on_removed = self._left
        if disk is not None:
            disk.on_removed = self._left
        if disk is not None:
            memory.spill_ahead_bytes = disk.spill_ahead_bytes
            memory.lends_spills = True

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

    def _unannounced(self, key: ChunkKey) -> bool:
        return self.events is not None and not self.events.announced(key)

    def _left(self, key: ChunkKey) -> None:
        """A tier dropped ``key``: announce it removed once no local tier holds it."""
        if self.events is not None and self.events.announced(key) and self._where(key) is None:
            self.events.removed(key)

    async def get_many(self, namespace: str, digests: Sequence[bytes]) -> list[Chunk | None]:
        """One Chunk per hit (release each: memory hits are leased), None per miss,
        in the order asked.  Each lower tier is read for the whole batch at once:
        disk reads run concurrently (up to the disk's I/O threads), Redis is one
        round trip (:mod:`.batchread`).  If a tier read fails, the leases already
        taken are released before the error propagates."""
        return await read_batch(self, [ChunkKey(namespace, d) for d in digests])

    async def promote(self, tier: str, key: ChunkKey, chunk: Chunk) -> Chunk:
        """Copy a lower-tier hit into the pool (off the loop) and serve the pool copy,
        leased like any memory hit (zero-copy and shared-memory replies need it
        there); the hit as read when there is no room."""
        reservation = self.memory.prepare_store(key, chunk.nbytes)
        if not isinstance(reservation, Reservation):
            promoted = self.memory.lease(key) if reservation is PutStatus.EXISTS else None
        else:

            async def fill() -> bool:
                await self.offload.copy(reservation.view, chunk.data)
                return True

            promoted = None
            if await fill_reservation(self.memory, reservation, fill()) is PutStatus.STORED:
                self.promotions[tier] += 1
                promoted = self.memory.lease(key)
        if promoted is None:
            return chunk
        chunk.release()
        return promoted

    async def promote_from_disk(self, disk: DiskTier, key: ChunkKey) -> Chunk | None:
        """Read a disk chunk straight into reserved pool memory (one copy, then a
        zero-copy send); None if it is not on disk or there is no room."""
        size = disk.payload_size(key)
        if size is None:
            return None
        reservation = self.memory.prepare_store(key, size)
        if not isinstance(reservation, Reservation):
            return self.memory.lease(key) if reservation is PutStatus.EXISTS else None

        async def fill() -> bool:
            return await disk.get(key, reservation.view) is not None

        if await fill_reservation(self.memory, reservation, fill()) is PutStatus.STORED:
            self.promotions[disk.name] += 1
        return self.memory.lease(key)

    def reserve(
        self,
        namespace: str,
        digests: Sequence[bytes],
        sizes: Sequence[int],
        tokens: Sequence[ChunkTokens | None] | None = None,
    ) -> list[Reservation | PutStatus]:
        """Phase one of a put: room in the pool for each chunk (invisible to
        readers until :meth:`commit`), or the PutStatus saying why there is none.
        A key repeated within the batch, or still filling from an earlier put,
        is EXISTS.  ``tokens`` (one per digest) travel with the reservations
        until commit announces them."""
        out: list[Reservation | PutStatus] = []
        reserved: set[ChunkKey] = set()
        # Consecutive keys of one put are (nearly always) one prefix chain: the
        # previous key is a hint to the eviction policy.
        parent: ChunkKey | None = None
        for i, (digest, size) in enumerate(zip(digests, sizes)):
            key = ChunkKey(namespace, digest)
            if key in reserved or key in self.filling:
                out.append(PutStatus.EXISTS)
                continue
            reservation = self.memory.prepare_store(key, size, parent)
            told = self._told(tokens, i)
            if isinstance(reservation, Reservation):
                reserved.add(key)
                reservation.tokens = told
            elif reservation is PutStatus.EXISTS:
                self._announce_stored_before(key, told)
            out.append(reservation)
            parent = key
        return out

    def _told(self, tokens: Sequence[ChunkTokens | None] | None, i: int) -> ChunkTokens | None:
        """Chunk ``i``'s token ids, when the put sent them and KV events are on."""
        return tokens[i] if tokens is not None and self.events is not None else None

    def _announce_stored_before(self, key: ChunkKey, told: ChunkTokens | None) -> None:
        """A put with token ids found ``key`` stored before without them (an older
        client, a warm restart): announce it now."""
        if told is not None and self._unannounced(key):
            self.events.stored(key, told, self.memory.name)  # type: ignore[union-attr]

    async def reserve_waiting(
        self,
        namespace: str,
        digests: Sequence[bytes],
        sizes: Sequence[int],
        tokens: Sequence[ChunkTokens | None] | None = None,
    ) -> list[Reservation | PutStatus]:
        """:meth:`reserve`, waiting (at most ``ROOM_WAIT_S``) for room that chunks
        lent to the spill will free once the disk has them."""
        outcomes = self.reserve(namespace, digests, sizes, tokens)
        deadline = time.monotonic() + ROOM_WAIT_S
        while True:
            coming = self.memory.room_coming
            waiting = [i for i, o in enumerate(outcomes) if o is PutStatus.NO_SPACE and coming(sizes[i])]
            if not waiting:
                break
            if not await self.memory.wait_for_room(deadline - time.monotonic()):
                self.memory.counters.rejections += len(waiting)  # gave up: a refusal after all
                break
            for i in waiting:
                one = None if tokens is None else tokens[i : i + 1]
                outcomes[i] = self.reserve(namespace, digests[i : i + 1], sizes[i : i + 1], one)[0]
        return outcomes

    def stage(self, sizes: Sequence[int]) -> list[Reservation] | None:
        """Room for a shared-memory writer's next put, bound to no key yet (staged
        slots, invisible and never evicted): one per size, or None (nothing kept)
        when the pool cannot hold them all now."""
        rooms: list[Reservation] = []
        if sum(sizes) > self.memory.allocator.capacity:
            return None
        for size in sizes:
            room = self.memory.reserve_room(size)
            if room is None:
                for r in rooms:
                    self.abort(r)
                return None
            rooms.append(room)
        return rooms

    def bind(
        self,
        namespace: str,
        digests: Sequence[bytes],
        rooms: Sequence[Reservation],
        tokens: Sequence[ChunkTokens | None] | None = None,
        taken: list[Reservation] | None = None,
    ) -> list[PutStatus]:
        """A put into staged room (:meth:`stage`), already written: each room bound
        to its key with :meth:`reserve`'s checks and committed at once.  STORED
        consumed the room; any other status leaves it staged.  ``taken`` gets
        each consumed room as it is consumed (before its commit: known even if
        this raises midway)."""
        out: list[PutStatus] = []
        parent: ChunkKey | None = None
        for i, (digest, room) in enumerate(zip(digests, rooms)):
            key = ChunkKey(namespace, digest)
            if key in self.filling:
                out.append(PutStatus.EXISTS)
                continue
            told = self._told(tokens, i)
            bound = self.memory.bind_room(room, key, parent)
            if isinstance(bound, Reservation):
                bound.tokens = told
                if taken is not None:
                    taken.append(room)
                out.append(self.commit(bound))
            else:
                if bound is PutStatus.EXISTS:
                    self._announce_stored_before(key, told)
                out.append(bound)
            parent = key
        return out

    def commit(self, reservation: Reservation) -> PutStatus:
        """Phase two: the filled reservation becomes visible, and is queued for Redis."""
        status = self.memory.complete_store(reservation)
        if status is PutStatus.STORED:
            if self.remote is not None:
                self._uplink(reservation.key)
            if reservation.tokens is not None and self.events is not None:
                self.events.stored(reservation.key, reservation.tokens, self.memory.name)
        reservation.tokens = None
        return status

    def _uplink(self, key: ChunkKey) -> None:
        """Queue a stored chunk for Redis; leased until its record is built (off the loop)."""
        assert self.remote is not None
        lease = self.memory.lease(key)
        if lease is not None:
            self.remote.enqueue(key, lease.data, lease.release)

    def uplink_again(self, key: ChunkKey) -> bool:
        """Queue ``key`` for Redis if memory holds it (True); for writes a previous
        daemon owed Redis (:meth:`.RedisTier.requeue`)."""
        if self.remote is None:
            return False
        lease = self.memory.lease(key)
        return lease is not None and self.remote.enqueue(key, lease.data, lease.release)

    def abort(self, reservation: Reservation) -> None:
        self.memory.abort_store(reservation)

    async def prepare_puts(
        self,
        namespace: str,
        digests: Sequence[bytes],
        payloads: Sequence[Any],
        tokens: Sequence[ChunkTokens | None] | None = None,
    ) -> tuple[list[PutStatus], Callable[[], asyncio.Future[None] | None]]:
        """A put of payload frames: the statuses to answer now, and ``finish``.
        ``tokens``: one per digest (or None), announced once the chunk is visible.

        ``finish`` starts copying the payloads in (off the event loop) and
        returns a future done once every chunk is visible (None: nothing to
        copy); the payloads must stay alive until then.  The server calls it
        right after queueing the reply, in the same event-loop step: from then
        on the chunks are *filling*, and reads of them wait, so no request can
        observe the gap, while ZeroMQ's I/O thread already receives the
        client's next request and the event loop serves others.
        """
        if self.filling:
            # One generation of copies at a time: this put's reply waits until the
            # earlier puts' chunks are in (milliseconds), so a client streaming
            # puts faster than they are copied is slowed down rather than piling
            # up payloads, and those chunks are evictable again before this
            # put asks for room.
            await self.filling.wait()
        sources = [memoryview(p).cast("B") for p in payloads]
        outcomes = await self.reserve_waiting(namespace, digests, [src.nbytes for src in sources], tokens)
        pending = [(r, src) for r, src in zip(outcomes, sources) if isinstance(r, Reservation)]
        statuses = [PutStatus.STORED if isinstance(r, Reservation) else r for r in outcomes]

        def finish() -> asyncio.Future[None] | None:
            return self.filling.start(pending) if pending else None

        return statuses, finish

    async def put_many(
        self,
        namespace: str,
        digests: Sequence[bytes],
        payloads: Sequence[Any],
        tokens: Sequence[ChunkTokens | None] | None = None,
    ) -> list[PutStatus]:
        """Store the chunks now (prepare_puts, then wait for finish)."""
        statuses, finish = await self.prepare_puts(namespace, digests, payloads, tokens)
        done = finish()
        if done is not None:
            await done
        return statuses

    def _where(self, key: ChunkKey) -> str | None:
        if key in self.filling:
            return self.memory.name
        return next((t.name for t in self.tiers if t.peek(key)), None)

    def _locate_local(self, namespace: str, digests: Sequence[bytes]) -> list[str | None]:
        """The fastest local tier (memory, disk) holding each key; None where none does."""
        # Plain tuples hash and compare like ChunkKeys (a NamedTuple), at a sixth of
        # the cost of building one: these only test membership (ChunkKeys for Redis below).
        keys = cast(list[ChunkKey], [(namespace, d) for d in digests])
        memory = self.memory.name
        if not self.filling:  # the common case: one pass over the memory index answers it
            found = self.memory.peek_many(keys)
            if all(found):
                return [memory] * len(keys)
            tiers: list[str | None] = [memory if f else None for f in found]
            rest = self.tiers[1:]
        else:
            tiers = [memory if f else None for f in self.filling.peek_many(keys)]
            rest = self.tiers
        # One membership pass per tier over the keys still unplaced (a lookup asks
        # for up to max_keys_per_request keys at a time), not a call per key and tier.
        for tier in rest:
            if tier is self.remote:  # asked by _locate, in one round trip
                continue
            missing = [i for i, t in enumerate(tiers) if t is None]
            if not missing:
                break
            found = tier.peek_many(keys if len(missing) == len(keys) else [keys[i] for i in missing])
            for i, hit in zip(missing, found):
                if hit:
                    tiers[i] = tier.name
        return tiers

    async def _locate(self, namespace: str, digests: Sequence[bytes]) -> list[str | None]:
        tiers = self._locate_local(namespace, digests)
        if self.remote is not None and None in tiers:
            # One round trip for every key no local tier holds.
            missing = [i for i, t in enumerate(tiers) if t is None]
            found = await self.remote.exists_many([ChunkKey(namespace, digests[i]) for i in missing])
            for i, hit in zip(missing, found):
                if hit:
                    tiers[i] = self.remote.name
        return tiers

    def _counted(self, tiers: list[str | None]) -> tuple[int, list[str | None]]:
        hits = len(tiers) if None not in tiers else tiers.index(None)
        c = self.lookup_counters
        c.lookups += 1
        c.chunks_asked += len(tiers)
        c.chunks_hit += hits
        return hits, tiers

    async def lookup(self, namespace: str, digests: Sequence[bytes]) -> tuple[int, list[str | None]]:
        """Leading-hit count and the fastest tier holding each key (None: not stored)."""
        return self._counted(await self._locate(namespace, digests))

    def lookup_now(self, namespace: str, digests: Sequence[bytes]) -> tuple[int, list[str | None]] | None:
        """:meth:`lookup` answered without waiting, or None when it must ask Redis
        (some key is in no local tier and a remote tier is configured)."""
        tiers = self._locate_local(namespace, digests)
        if self.remote is not None and None in tiers:
            return None
        return self._counted(tiers)

    async def exists(self, namespace: str, digests: Sequence[bytes]) -> list[bool]:
        return [t is not None for t in await self._locate(namespace, digests)]

    async def delete(self, namespace: str, digests: Sequence[bytes]) -> list[bool]:
        out = []
        for digest in digests:
            key = ChunkKey(namespace, digest)
            await self.filling.filled(key)
            out.append(any([await t.delete(key) for t in self.tiers]))
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
        out: dict[str, Any] = {
            "tiers": tiers,
            "lookups": c.lookups,
            "lookup_chunks": c.chunks_asked,
            "lookup_hit_chunks": c.chunks_hit,
            "lookup_hit_rate": round(c.chunks_hit / c.chunks_asked, 4) if c.chunks_asked else 0.0,
        }
        if self.events is not None:
            out["events"] = self.events.stats()
        per_tier = {t.name: t.namespaces() for t in self.tiers}
        if namespace is not None:
            out["namespace"] = {"name": namespace, **_namespace_stats(per_tier, namespace)}
        else:
            names = sorted({ns for counts in per_tier.values() for ns in counts})
            out["namespaces"] = {ns: _namespace_stats(per_tier, ns) for ns in names}
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
