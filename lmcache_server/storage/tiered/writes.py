"""The tiered store's writes (:class:`Writes`, a part of :class:`.store.TieredStore`):
the two-phase put and its variants.

- ``reserve`` (phase one) takes room in the pool for each chunk, invisible
  until ``commit`` (phase two) makes it readable and queues it for Redis;
  ``abort`` gives the room back.  ``reserve_waiting`` waits (at most
  ``ROOM_WAIT_S``) for room that spills being written will free.
- A put of payload frames (``prepare_puts``, ``put_many``) is answered once its
  room is reserved; the payloads are copied in off the event loop and the
  chunks are *filling* meanwhile (:mod:`.filling`).
- A shared-memory writer puts into room staged ahead (``stage``), bound to its
  keys and committed at once (``bind``).
- The tier gate (:mod:`.gate`): a commit, and a put of a key stored or
  filling, tell it; Redis gets a chunk when it passes it (``always``: at commit;
  the queueing is :mod:`.uplink`'s).
- KV events: a put with token ids is announced when its chunk becomes
  readable, or at once when the chunk was stored before without them.

Primitives: :class:`Commit` (phase two), :class:`Writes` (``reserve``, ``reserve_waiting``,
``stage``, ``bind``, ``abort``, ``prepare_puts``, ``put_many``, ``accessed``), ``ROOM_WAIT_S``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from lmcache_client.keys import ChunkTokens
from lmcache_client.protocol import PutStatus

from ..base import ChunkKey
from ..memory import Reservation
from .filling import Filling
from .gate import StoreGate
from .residence import Residence
from .roles import Memory
from .uplink import Uplinking

ROOM_WAIT_S = 5.0
"""How long a put waits for room that spills being written will free."""


class Commit:
    """Phase two of a put: the filled reservation becomes visible, is announced and
    is queued for Redis (the fills of :mod:`.filling` and a shared-memory bind call it)."""

    def __init__(self, memory: Memory, residence: Residence, uplinking: Uplinking):
        self._memory = memory
        self._residence = residence
        self._uplinking = uplinking

    def __call__(self, reservation: Reservation) -> PutStatus:
        status = self._memory.commit(reservation)
        if status is PutStatus.STORED:
            key = reservation.key
            self._residence.in_memory(
                key, reservation.tokens, self._memory.name
            )  # first: its Redis record carries them
            self._uplinking.stored(key, reservation.size)
        reservation.tokens = None
        return status


class Writes:
    """The store's writes: ``commit`` is :class:`Commit` (also the fills'), ``filling``
    the puts still copying in."""

    def __init__(
        self,
        memory: Memory,
        filling: Filling,
        commit: Commit,
        residence: Residence,
        uplinking: Uplinking,
        gate: StoreGate | None,
    ):
        self._memory = memory
        self._filling = filling
        self.commit = commit
        self._residence = residence
        self._uplinking = uplinking
        self._gate = gate

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
            if key in reserved or key in self._filling:
                if key not in reserved:
                    self.accessed(key)  # put again while the first put's copy runs
                out.append(PutStatus.EXISTS)
                continue
            reservation = self._memory.reserve(key, size, parent)
            told = self._told(tokens, i)
            if isinstance(reservation, Reservation):
                reserved.add(key)
                reservation.tokens = told
            elif reservation is PutStatus.EXISTS:
                self.accessed(key)
                self._announce_stored_before(key, told)
            out.append(reservation)
            parent = key
        return out

    def _told(self, tokens: Sequence[ChunkTokens | None] | None, i: int) -> ChunkTokens | None:
        """Chunk ``i``'s token ids, when the put sent them and KV events are on."""
        return tokens[i] if tokens is not None and self._residence.events is not None else None

    def _announce_stored_before(self, key: ChunkKey, told: ChunkTokens | None) -> None:
        """A put with token ids found ``key`` stored before without them (an older
        client, a warm restart): announce it now."""
        events = self._residence.events
        if told is not None and events is not None and not events.announced(key):
            events.stored(key, told, self._memory.name)

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
            coming = self._memory.room_coming
            waiting = [i for i, o in enumerate(outcomes) if o is PutStatus.NO_SPACE and coming(sizes[i])]
            if not waiting:
                break
            if not await self._memory.wait_for_room(deadline - time.monotonic()):
                self._memory.counters.rejections += len(waiting)  # gave up: a refusal after all
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
        if sum(sizes) > self._memory.allocator.capacity:
            return None
        for size in sizes:
            room = self._memory.reserve_room(size)
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
            if key in self._filling:
                self.accessed(key)
                out.append(PutStatus.EXISTS)
                continue
            told = self._told(tokens, i)
            bound = self._memory.bind_room(room, key, parent)
            if isinstance(bound, Reservation):
                bound.tokens = told
                if taken is not None:
                    taken.append(room)
                out.append(self.commit(bound))
            else:
                if bound is PutStatus.EXISTS:
                    self.accessed(key)
                    self._announce_stored_before(key, told)
                out.append(bound)
            parent = key
        return out

    def accessed(self, key: ChunkKey) -> None:
        """``key`` was read or put again: tell the gate, and queue it for Redis if
        the gate passes it now."""
        if self._gate is not None:
            self._uplinking.accessed(key, self._memory.peek(key) or key in self._filling)

    def abort(self, reservation: Reservation) -> None:
        self._memory.abort(reservation)

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
        if self._filling:
            # One generation of copies at a time: this put's reply waits until the
            # earlier puts' chunks are in (milliseconds), so a client streaming
            # puts faster than they are copied is slowed down rather than piling
            # up payloads, and those chunks are evictable again before this
            # put asks for room.
            await self._filling.wait()
        sources = [memoryview(p).cast("B") for p in payloads]
        outcomes = await self.reserve_waiting(namespace, digests, [src.nbytes for src in sources], tokens)
        pending = [(r, src) for r, src in zip(outcomes, sources) if isinstance(r, Reservation)]
        statuses = [PutStatus.STORED if isinstance(r, Reservation) else r for r in outcomes]

        def finish() -> asyncio.Future[None] | None:
            return self._filling.start(pending) if pending else None

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
