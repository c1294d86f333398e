"""What the remote tier owed its store (Redis or Mooncake) at a clean stop, carried to the next start
(:class:`RemoteCarryover`, a part :class:`.tier.RemoteTier` builds and holds).

The tier's ``open`` calls ``load``: it takes over the removals and writes the
last stop left in ``state_path`` (:mod:`.pending`): the removals are queued to
be sent before anything else, the writes wait for :meth:`RemoteCarryover.requeue`
(after a warm restart adopted the chunks).  The tier's ``close`` calls ``save``:
it saves what is still owed.

Primitives: :class:`RemoteCarryover` (``load``, ``requeue``, ``save``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from ...config import redact
from ..base import ChunkKey
from .links import RemoteLink
from .pending import Pending
from .pending import load as load_pending
from .pending import save as save_pending
from .queue import WriteQueue

logger = logging.getLogger("lmcache_server.storage.remote.tier")  # the tier's log lines keep their logger name


class RemoteCarryover:
    """The pending state of :class:`.tier.RemoteTier` across a clean stop: what
    ``queue`` owes Redis (on ``link``), kept in ``state_path`` (None: not kept)."""

    def __init__(self, link: RemoteLink, queue: WriteQueue, state_path: Path | None):
        self._link = link
        self.queue = queue
        self.state_path = state_path
        self.unwritten: list[ChunkKey] = []  # writes owed at the last stop: see requeue

    def _target(self) -> str:
        return f"{redact(self._link.url)} {self._link.key_prefix}"

    def load(self) -> None:
        if self.state_path is None:
            return
        pending = load_pending(self.state_path, self._target())
        if pending is None:
            return
        for namespace in pending.clears:
            self.queue.remember_clear(namespace)
        for key in pending.deletes:
            self.queue.remember_delete(key)
        self.unwritten = pending.writes
        logger.info("%s: the last stop left %d clears, %d deletes and %d writes pending; removals are sent first",
                    self._link.label, len(pending.clears), len(pending.deletes), len(pending.writes))  # fmt: skip

    def requeue(self, enqueue: Callable[[ChunkKey], bool]) -> None:
        """Queue again the writes the last stop left pending, through ``enqueue``
        (True: this daemon still holds the chunk and queued it); log the rest."""
        keys, self.unwritten = self.unwritten, []
        if not keys:
            return
        queued = sum(1 for key in keys if not self.queue.removing(key) and enqueue(key))
        self._link.state.counters.dropped_writes += len(keys) - queued
        logger.log(
            logging.WARNING if queued < len(keys) else logging.INFO,
            "%s: re-queued %d writes pending at the last stop; %d dropped (no longer held here)",
            self._link.label, queued, len(keys) - queued,
        )  # fmt: skip

    def save(self) -> None:
        if self.state_path is None:
            return
        clears, deletes, writes = self.queue.pending()
        writes += [key for key in self.unwritten if key not in set(writes)]
        pending = Pending(self._target(), clears, deletes, writes)
        try:
            save_pending(self.state_path, pending)
        except OSError as err:
            logger.warning("%s: cannot save what is pending to %s (%s): %d clears, %d deletes"
                           " and %d writes are lost", self._link.label, self.state_path, err, len(clears), len(deletes),
                           len(writes))  # fmt: skip
            return
        if pending:
            logger.warning("%s: %d clears, %d deletes and %d writes still pending; saved to %s for the next start",
                           self._link.label, len(clears), len(deletes), len(writes), self.state_path)  # fmt: skip
