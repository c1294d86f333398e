"""The disk tier's write-behind queue: spills wait here, readable, until written.

A spill is either *lent* (a pool extent the memory tier keeps unchanged until
``release()`` is called) or a copy, made in a page-aligned buffer when the tier
writes with O_DIRECT and recycled after the write (chunks of one model are all
one size, and faulting in a fresh mapping costs more than the copy).  The
queue is bounded in bytes; the tier decides what to drop.  Deleting a queued
chunk cancels its write: the writer finds it is no longer the current entry.

Primitive: :class:`SpillQueue` (``add``, ``copy``, ``next``, ``is_current``,
``done``, ``cancel``, ``cancel_namespace``, ``release_all``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

from ..base import ChunkKey
from .files import aligned_copy

Release = Callable[[], None]

SPARE_BUFFERS = 4
SPARE_MAX_BYTES = 64 << 20


class SpillQueue:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.direct = False  # copies page-aligned for O_DIRECT writes (write_direct, when the tier opens)
        self.nbytes = 0  # queued bytes
        self._pending: dict[ChunkKey, memoryview] = {}  # written soon; readable meanwhile
        self._queue: asyncio.Queue[tuple[ChunkKey, memoryview, Release | None]] = asyncio.Queue()
        self._spare: list[memoryview] = []  # page-aligned copy buffers of written spills, for reuse

    def write_direct(self, direct: bool) -> None:
        """Whether the writer uses O_DIRECT (known once the tier opens): spills are then
        copied into page-aligned buffers."""
        self.direct = direct

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._pending

    def __len__(self) -> int:
        return len(self._pending)

    def get(self, key: ChunkKey) -> memoryview | None:
        return self._pending.get(key)

    def __iter__(self) -> Iterator[ChunkKey]:
        return iter(list(self._pending))

    def fits(self, size: int) -> bool:
        return self.nbytes + size <= self.max_bytes

    def idle(self) -> bool:
        """Nothing queued and nothing being written."""
        return not self._pending and not self._queue.qsize()

    def copy(self, view: memoryview) -> memoryview:
        """A private copy of a spill that cannot be lent (page-aligned for O_DIRECT)."""
        if not self.direct:
            return memoryview(bytes(view))
        for i, spare in enumerate(self._spare):
            if spare.nbytes == view.nbytes:
                del self._spare[i]
                spare[:] = view
                return spare
        return aligned_copy(view)

    def add(self, key: ChunkKey, view: memoryview, release: Release | None) -> None:
        """Queue ``view`` (a copy, or lent bytes given back by ``release``)."""
        self._pending[key] = view
        self.nbytes += view.nbytes
        self._queue.put_nowait((key, view, release))

    async def next(self) -> tuple[ChunkKey, memoryview, Release | None]:
        return await self._queue.get()

    def is_current(self, key: ChunkKey, view: memoryview) -> bool:
        """Whether ``view`` is still what is queued for ``key`` (not deleted meanwhile)."""
        return self._pending.get(key) is view

    def done(self, key: ChunkKey, view: memoryview, release: Release | None) -> None:
        """The write of ``view`` is over (written, failed or cancelled)."""
        if self._pending.get(key) is view:
            del self._pending[key]
        self.nbytes -= view.nbytes
        if release is not None:
            release()
        elif self.direct:  # keep the newest few copy buffers, bounded in bytes
            self._spare.append(view)
            while len(self._spare) > SPARE_BUFFERS or sum(v.nbytes for v in self._spare) > SPARE_MAX_BYTES:
                self._spare.pop(0)

    def cancel(self, key: ChunkKey) -> bool:
        """Forget a queued chunk (the writer skips it); True if it was queued."""
        return self._pending.pop(key, None) is not None

    def cancel_namespace(self, namespace: str | None) -> list[ChunkKey]:
        """Cancel every queued chunk of ``namespace`` (None: all); returns their keys."""
        keys = [k for k in self._pending if namespace is None or k.namespace == namespace]
        for key in keys:
            del self._pending[key]
        return keys

    def release_all(self) -> None:
        """At close, with the writers stopped: give every lent buffer back."""
        while not self._queue.empty():
            _, _, release = self._queue.get_nowait()
            if release is not None:
                release()
        self._pending.clear()
