"""The spill: a chunk memory evicts goes to the spill target (the disk), if the gate
lets it.

Memory calls :meth:`Spill.evicted` with a leased chunk: *lent* (written straight
from the pool and released once written, so the spill runs ahead of the puts
that will need the room) or, when a put waits for its room, copied into the
target's write-behind queue.

:class:`StoreListener` is what the store answers on the tiers' links
(:class:`..base.TierLinks`): memory's victims go to the spill, the tiers'
removals and the records' token ids to :class:`.residence.Residence`.

Primitives: :class:`Spill` (``evicted``), :class:`StoreListener`.
"""

from __future__ import annotations

from lmcache_client.keys import ChunkTokens

from ..base import Chunk, ChunkKey
from .gate import StoreGate
from .residence import Residence
from .roles import SpillTarget


class Spill:
    def __init__(self, disk: SpillTarget | None, gate: StoreGate | None):
        self._disk = disk
        self._gate = gate

    def evicted(self, key: ChunkKey, chunk: Chunk, lend: bool) -> bool:
        """An evicted chunk goes to disk: lent (written straight from the pool,
        released when written) or, when a put waits for its room, copied.
        False declines a lent chunk (the disk would drop it, or the gate does not
        pass it yet), so it stays in memory; a chunk the gate stops when a put
        needs its room is dropped (counted)."""
        disk = self._disk
        gate = self._gate
        if disk is None or disk.peek(key):
            chunk.release()  # nothing to write: already on disk (or queued), or no disk
            if gate is not None:
                gate.evicted(key)
            return True
        if lend and not disk.accepts(chunk.nbytes):
            return False
        if gate is not None:
            if not gate.spill(key, chunk.nbytes, lambda: disk.victim_for(chunk.nbytes), final=not lend):
                if lend:
                    return False
                chunk.release()
                gate.evicted(key)
                return True
            gate.evicted(key)
        if lend:
            return disk.enqueue(key, chunk.data, chunk.release)
        disk.enqueue(key, chunk.data)
        return True


class StoreListener:
    """The store's :class:`..base.TierListener`."""

    def __init__(self, spill: Spill, residence: Residence):
        self._spill = spill
        self._residence = residence

    def evicted(self, key: ChunkKey, chunk: Chunk, lend: bool) -> bool:
        return self._spill.evicted(key, chunk, lend)

    def left_memory(self, key: ChunkKey) -> None:
        self._residence.left_memory(key)

    def left_disk(self, key: ChunkKey) -> None:
        self._residence.left(key)

    def tokens_of(self, key: ChunkKey) -> ChunkTokens | None:
        return self._residence.tokens_of(key)
