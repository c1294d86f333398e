"""The uplink of stored chunks: what memory holds, queued for the shared tier (Redis).

- :meth:`Uplinking.stored`: a chunk committed to memory is queued, when the gate
  passes it (no gate: always).
- :meth:`Uplinking.accessed`: a chunk read or put again is told to the gate, and
  queued if the gate passes it now.
- :meth:`Uplinking.again`: a write a previous daemon owed Redis, queued again.

A queued chunk is leased from memory until its record is built (off the loop).

Primitives: :class:`Uplinking` (``stored``, ``accessed``, ``again``).
"""

from __future__ import annotations

from ..base import ChunkKey
from .gate import StoreGate
from .roles import Memory, Uplink


class Uplinking:
    def __init__(self, memory: Memory, remote: Uplink | None, gate: StoreGate | None):
        self._memory = memory
        self._remote = remote
        self._gate = gate

    def stored(self, key: ChunkKey, size: int) -> None:
        """``key`` was committed to memory: queue it for Redis if the gate passes it."""
        gate = self._gate
        if gate is None:
            if self._remote is not None:
                self._enqueue(key)
        elif gate.stored(key, size) and self._enqueue(key):
            gate.uplinked(key, size)

    def accessed(self, key: ChunkKey, resident: bool) -> None:
        """``key`` was read or put again (``resident``: memory holds it, or a put of it
        is filling): tell the gate, and queue it for Redis if the gate passes it now."""
        gate = self._gate
        if gate is None:
            return
        if gate.accessed(key, resident) and self._remote is not None:
            lease = self._memory.lease(key)
            if lease is not None:
                size = lease.nbytes
                if self._remote.enqueue(key, lease.data, lease.release):
                    gate.uplinked(key, size)

    def again(self, key: ChunkKey) -> bool:
        """Queue ``key`` for Redis if memory holds it (True); for writes a previous
        daemon owed Redis (:meth:`..remote.RemoteTier.requeue`)."""
        if self._remote is None:
            return False
        return self._enqueue(key)

    def _enqueue(self, key: ChunkKey) -> bool:
        """Queue a stored chunk for Redis; leased until its record is built (off the loop).
        False: memory does not hold it, or the queue is full (dropped, counted)."""
        assert self._remote is not None
        lease = self._memory.lease(key)
        return lease is not None and self._remote.enqueue(key, lease.data, lease.release)
