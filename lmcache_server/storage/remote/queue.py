"""The Redis uplink's write-behind queue: what is still to be written to (or removed from) Redis.

- Writes: one entry per key, in arrival order, bounded by payload bytes.  An
  entry is added at once (the room is taken) and its record built off the
  event loop; the writer takes the oldest built entry, and the entry leaves the
  queue only when Redis acknowledged it, so a write that failed (Redis went
  away) is written again once it is back, never dropped.
- A write whose payload stays in the memory pool until it is sent (Mooncake's puts
  from the pool, :mod:`.mooncake`) holds the pool's lease: ``release`` is called
  once, when it leaves the queue (written, dropped, removed) and its header is
  no longer being built.
- Removals: deleting or clearing a queued chunk takes it out of the queue (a
  queued SET must not re-create a deleted chunk).  A chunk whose SET may
  already be on its way (the one being written, or one whose write failed
  half-way) and removals Redis could not be told about (it was down) are
  remembered and sent before any later write: pending deletes (bounded in
  count) and pending clears (one per namespace, or all).

Primitive: :class:`WriteQueue` (``fits``, ``add``, ``built``, ``head``, ``heads``,
``done``, ``cancel``, ``cancel_namespace``, ``remember_delete``,
``remember_clear``, ``take_removals``, ``removing``, ``idle``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from ..base import ChunkKey

logger = logging.getLogger(__name__)

MAX_PENDING_DELETES = 65536


@dataclasses.dataclass(slots=True, eq=False)
class Write:
    key: ChunkKey
    size: int
    record: Any = None  # None until built: the record, or (header, payload in the pool)
    release: Callable[[], None] | None = None  # the pool's lease of the payload, held until it leaves
    building: bool = False  # its record (or header) is being built off the loop
    cancelled: bool = False  # deleted (or cleared) after it was queued
    attempted: bool = False  # a SET of it was sent at least once (it may have landed)
    failures: int = 0  # unexpected (non-Redis) errors while writing it


class WriteQueue:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.lost_deletes = 0  # removals not remembered (over MAX_PENDING_DELETES)
        self._writes: dict[ChunkKey, Write] = {}
        self._deletes: set[ChunkKey] = set()
        self._clears: set[str | None] = set()

    def __len__(self) -> int:
        return len(self._writes)

    @property
    def pending_removals(self) -> int:
        return len(self._deletes) + len(self._clears)

    def fits(self, size: int) -> bool:
        return self.nbytes + size <= self.max_bytes

    def idle(self) -> bool:
        """Nothing to write and nothing to remove."""
        return not self._writes and not self._deletes and not self._clears

    def add(self, key: ChunkKey, size: int, release: Callable[[], None] | None = None) -> Write | None:
        """Take room for a write of ``key`` (None: already queued); ``release``: the pool
        lease the write holds until it leaves the queue."""
        if key in self._writes:
            return None
        write = Write(key, size, release=release)
        self._writes[key] = write
        self.nbytes += size
        return write

    def built(self, write: Write, record: Any) -> bool:
        """The record of ``write`` is ready; False if it was removed meanwhile (its lease,
        if it holds one, is released now)."""
        write.building = False
        if self._writes.get(write.key) is not write:
            self.released(write)
            return False
        write.record = record
        return True

    @staticmethod
    def released(write: Write) -> None:
        """Give back the pool lease ``write`` holds (once; never while its header is built)."""
        release, write.release = write.release, None
        if release is not None and not write.building:
            release()
        elif release is not None:
            write.release = release  # the builder gives it back when it is done (built)

    def head(self) -> Write | None:
        """The oldest write whose record is built (None if none is)."""
        return next((w for w in self._writes.values() if w.record is not None), None)

    def heads(self, max_writes: int, max_bytes: int) -> list[Write]:
        """The oldest built writes, at most ``max_writes`` and (past the first) ``max_bytes``."""
        out: list[Write] = []
        nbytes = 0
        for write in self._writes.values():
            if write.record is None:
                continue
            if out and (len(out) >= max_writes or nbytes + write.size > max_bytes):
                break
            out.append(write)
            nbytes += write.size
        return out

    def done(self, write: Write) -> None:
        """``write`` left the queue: written, or dropped (its record could not be built)."""
        if self._writes.get(write.key) is write:
            del self._writes[write.key]
            self.nbytes -= write.size
        self.released(write)

    def _remove(self, write: Write) -> None:
        write.cancelled = True
        del self._writes[write.key]
        self.nbytes -= write.size
        self.released(write)
        if write.attempted:  # the SET may still land: delete after it
            self.remember_delete(write.key)

    def cancel(self, key: ChunkKey) -> bool:
        """Take a queued write of ``key`` out; True if there was one."""
        write = self._writes.get(key)
        if write is None:
            return False
        self._remove(write)
        return True

    def cancel_namespace(self, namespace: str | None) -> int:
        """Take every queued write of ``namespace`` (None: all) out; how many."""
        writes = [w for k, w in self._writes.items() if namespace is None or k.namespace == namespace]
        for write in writes:
            self._remove(write)
        return len(writes)

    def remember_delete(self, key: ChunkKey) -> None:
        """Delete ``key`` in Redis before any later write (it is down, or a SET may still land)."""
        if len(self._deletes) >= MAX_PENDING_DELETES:
            if not self.lost_deletes:
                logger.warning("Redis uplink: over %d deletes wait for Redis; further ones are not remembered",
                               MAX_PENDING_DELETES)  # fmt: skip
            self.lost_deletes += 1
            return
        self._deletes.add(key)

    def remember_clear(self, namespace: str | None) -> None:
        """Clear ``namespace`` (None: every namespace) in Redis before any later write."""
        if None in self._clears:
            return
        if namespace is None:
            self._clears.clear()
            self._deletes.clear()
        elif any(k.namespace == namespace for k in self._deletes):
            self._deletes = {k for k in self._deletes if k.namespace != namespace}
        self._clears.add(namespace)

    def take_removals(self) -> tuple[list[str | None], list[ChunkKey]]:
        """The pending clears and deletes, handed to the writer (put back if they fail)."""
        clears, deletes = list(self._clears), list(self._deletes)
        self._clears.clear()
        self._deletes.clear()
        return clears, deletes

    def put_back(self, clears: list[str | None], deletes: list[ChunkKey]) -> None:
        """Removals the writer could not send."""
        for namespace in clears:
            self.remember_clear(namespace)
        covered = None in self._clears
        for key in deletes:
            if not covered and key.namespace not in self._clears:
                self.remember_delete(key)

    def removing(self, key: ChunkKey) -> bool:
        """Whether a removal Redis was not yet told about covers ``key`` (a read of
        it from Redis would bring back a deleted or cleared chunk)."""
        return key in self._deletes or None in self._clears or key.namespace in self._clears

    def abandoned(self, write: Write) -> None:
        """The builder of ``write`` was cancelled (the tier stops): a write that left the
        queue meanwhile gives its lease back now; a queued one at :meth:`release_all`."""
        write.building = False
        if self._writes.get(write.key) is not write:
            self.released(write)

    def release_all(self) -> None:
        """Give back every pool lease queued writes hold (the tier stops, its builders
        cancelled: no header is being built any more; the writes stay queued)."""
        for write in self._writes.values():
            write.building = False
            self.released(write)

    def pending(self) -> tuple[list[str | None], list[ChunkKey], list[ChunkKey]]:
        """What Redis still has to be told: clears, deletes, and the keys of queued writes."""
        return list(self._clears), list(self._deletes), list(self._writes)
