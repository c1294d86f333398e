"""Reservations being filled off the event loop: put payloads copied into the pool,
promotions read into it.

- :class:`Filling` tracks the chunks of answered puts whose payloads are still
  being copied in (a worker thread, :mod:`.offload`): a chunk is *filling*
  from the moment the put is answered until it is committed, and readers wait
  for it (``filled``, ``settled``), so a client answered STORED always sees its
  chunk.  ``wait`` lets a new put (and shutdown) wait for every fill.
- :func:`fill_reservation` runs one fill of a reservation and makes the chunk
  visible, or gives the room back if the fill fails, is refused or its caller
  is cancelled; in that last case only once the fill itself has ended, since a
  thread may still be writing into the room.

Primitives: :class:`Filling` (``start``, ``filled``, ``settled``, ``wait``,
``in``), :func:`fill_reservation`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from lmcache_client.protocol import PutStatus

from ...supervisor import Supervisor
from ..base import ChunkKey
from ..memory import Reservation
from ..offload import SMALL_BYTES, Offload, memcopy
from .roles import Memory

logger = logging.getLogger(__name__)


class Filling:
    def __init__(
        self, memory: Memory, offload: Offload, commit: Callable[[Reservation], PutStatus], supervisor: Supervisor
    ):
        self.memory = memory
        self.offload = offload
        self.commit = commit
        self.supervisor = supervisor
        self._keys: dict[ChunkKey, asyncio.Future[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._keys

    def peek_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        filling = self._keys
        return [key in filling for key in keys]

    def __bool__(self) -> bool:
        """Whether any fill is running."""
        return bool(self._tasks)

    async def filled(self, key: ChunkKey) -> None:
        """Return once ``key`` is not filling."""
        fill = self._keys.get(key)
        if fill is not None:
            await asyncio.shield(fill)

    async def settled(self, namespace: str | None) -> None:
        """Return once no chunk of ``namespace`` (None: any) is filling."""
        fills = [f for k, f in self._keys.items() if namespace is None or k.namespace == namespace]
        if fills:
            await asyncio.shield(asyncio.gather(*fills, return_exceptions=True))

    async def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for every fill running now (never cancelled: they write into the
        pool from a thread); True if none is left."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
        return not self._tasks

    def start(self, pending: list[tuple[Reservation, memoryview]]) -> asyncio.Future[None]:
        """Copy each source into its reservation and commit it; the future is done
        once all are (the sources must stay alive until then)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for reservation, _ in pending:
            self._keys[reservation.key] = done
        task = asyncio.get_running_loop().create_task(self._run(pending, done))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return done

    async def _run(self, pending: list[tuple[Reservation, memoryview]], done: asyncio.Future[None]) -> None:
        committed = 0
        try:
            await self._copy_all(pending)
            for reservation, _ in pending:
                self.commit(reservation)
                del self._keys[reservation.key]
                committed += 1
        except BaseException as err:  # not expected: the copy of two same-sized buffers
            for reservation, _ in pending[committed:]:
                self._keys.pop(reservation.key, None)
                self.memory.abort(reservation)
            if not isinstance(err, asyncio.CancelledError):
                self.supervisor.failed("put_fill", err)
        finally:
            done.set_result(None)

    async def _copy_all(self, pending: list[tuple[Reservation, memoryview]]) -> None:
        """Every source into its reservation: one worker-thread job per copy thread
        (split by bytes), not one per chunk, since each hop to a thread and back
        costs tens of microseconds and a put's chunks become visible together
        anyway (readers wait for the whole put).  Returns once no thread writes
        into the pool any more, also when a copy failed (then it raises)."""
        pairs = [(reservation.view, src) for reservation, src in pending]
        total = sum(dst.nbytes for dst, _ in pairs)
        if total < SMALL_BYTES:
            _copy_pairs(pairs)
            return
        groups: list[list[tuple[memoryview, memoryview]]] = [[] for _ in range(max(1, self.offload.threads))]
        loads = [0] * len(groups)
        for pair in pairs:  # biggest-first is not worth it: a put's chunks are (nearly) equal
            lightest = loads.index(min(loads))
            groups[lightest].append(pair)
            loads[lightest] += pair[0].nbytes
        jobs = [self.offload.run(_copy_pairs, group) for group in groups if group]
        # Wait for every job before raising: a slot may be aborted only once no thread copies into it.
        gathered = asyncio.gather(*jobs, return_exceptions=True)
        try:
            results = await asyncio.shield(gathered)
        except asyncio.CancelledError:
            await asyncio.wait([gathered])  # the threads finish their copies first
            raise
        for result in results:
            if isinstance(result, BaseException):
                raise result


def _copy_pairs(pairs: list[tuple[memoryview, memoryview]]) -> None:
    for dst, src in pairs:
        memcopy(dst, src)


async def fill_reservation(memory: Memory, reservation: Reservation, fill: Awaitable[bool]) -> PutStatus | None:
    """Run ``fill`` (it writes ``reservation.view``, possibly from another thread)
    and make the chunk visible if it returns True; None when it did not."""
    task = asyncio.ensure_future(fill)
    try:
        ok = await asyncio.shield(task)
    except asyncio.CancelledError:
        if task.done():
            memory.abort(reservation)
        else:
            task.add_done_callback(lambda t: _abandoned(memory, reservation, t))
        raise
    except BaseException:
        memory.abort(reservation)
        raise
    if not ok:
        memory.abort(reservation)
        return None
    return memory.commit(reservation)


def _abandoned(memory: Memory, reservation: Reservation, fill: asyncio.Future[bool]) -> None:
    """The fill of a cancelled read ended: now its room can go back."""
    if not fill.cancelled() and fill.exception() is not None:
        logger.warning("an abandoned read into the pool failed: %s", fill.exception())
    memory.abort(reservation)
