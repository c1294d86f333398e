"""Adopting a warm index (storage/memory/warmstart.py): the new daemon's empty
memory tier takes over the chunks of the index, and the shared-memory leases
alive at the stop are handed to server/shm/leases.py (read leases with their chunks,
write slots with their reservations).

Primitives: :class:`Adoption` (``restore``), :class:`WarmMemory`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Protocol

from ..base import Chunk, ChunkKey
from .entry import Entry, Reservation
from .pool import MemoryPool, Segment
from .warmindex import WarmIndex, _leases_kept


class WarmMemory(Protocol):
    """What a warm restart needs of the memory tier (:class:`.tier.MemoryTier` is
    one; this module does not import it)."""

    @property
    def pool(self) -> MemoryPool: ...

    def snapshot(self) -> list[tuple[ChunkKey, int, int, bool]]: ...

    def adopt(self, chunks: Sequence[tuple[ChunkKey, int, int, bool]], held: Sequence[tuple[int, int]]) -> None: ...

    def lease(self, key: ChunkKey) -> Chunk | None: ...

    def held_chunk(self, offset: int, size: int, held: dict[int, Entry] | None = None) -> Chunk: ...


@dataclasses.dataclass
class Adoption:
    """A segment locked for this daemon and the index it was left with."""

    segment: Segment
    index: WarmIndex

    def restore(
        self, memory: WarmMemory, now: float | None = None
    ) -> tuple[list[tuple[int, float, list[Chunk]]], list[tuple[int, float, dict[str, int] | None, list[Reservation]]]]:
        """Fill the (new, empty) ``memory`` tier from the index; returns the leases
        for server/shm/leases.py to take over: read leases still alive ``(lease,
        deadline, chunks)`` and write slots ``(lease, since, owner, reservations)``."""
        now = time.monotonic() if now is None else now
        reads, writes, held = _leases_kept(self.index, now)
        memory.adopt(self.index.chunks, held)
        at = {offset: (key, size) for key, offset, size, _ in self.index.chunks}
        # One held entry per extent, leased once per slot: two read leases (or one get
        # naming a key twice) on a chunk deleted before the stop free its extent once,
        # when the last of them ends.
        gone: dict[int, Entry] = {}
        read_grants = []
        for lease in reads:
            chunks = []
            for s in lease.slots:
                live = at.get(s.offset)
                found = memory.lease(live[0]) if live is not None and live[1] == s.size else None
                chunks.append(found if found is not None else memory.held_chunk(s.offset, s.size, gone))
            read_grants.append((lease.lease, lease.deadline, chunks))
        view = memory.pool.view
        write_grants = [
            (
                lease.lease,
                lease.deadline,
                lease.owner,
                [
                    Reservation(s.key or ChunkKey("", b""), s.offset, s.size, None, view[s.offset : s.offset + s.size])
                    for s in lease.slots
                ],
            )
            for lease in writes
        ]
        return read_grants, write_grants
