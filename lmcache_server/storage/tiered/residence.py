"""Where the store's chunks reside, told to the KV-event announcer and to the tier gate.

- :meth:`Residence.in_memory`: a chunk became readable in memory (a put, a
  promotion): announced with its token ids when it was not, else its medium is
  memory's again.
- :meth:`Residence.left_memory` / :meth:`Residence.left`: a tier dropped a chunk
  (the memory and disk tiers call them): announced removed once no local tier
  holds it (moved to Redis when Redis is known to hold it), else moved to where
  it now is; the gate forgets what it knew of it in memory.
- :meth:`Residence.tokens_of`: the token ids a record below memory carries (an
  announced chunk's, with ``record_tokens`` on).

Primitives: :class:`Residence` (``in_memory``, ``left_memory``, ``left``, ``tokens_of``,
``unannounced``).
"""

from __future__ import annotations

from collections.abc import Callable

from lmcache_client.keys import ChunkTokens

from ..base import ChunkKey, Residency
from .gate import StoreGate


class Residence:
    """``where``: the fastest local tier holding a key (the lookups'); ``remote``: the
    uplink's tier name (None: no uplink)."""

    def __init__(
        self,
        events: Residency | None,
        record_tokens: bool,
        gate: StoreGate | None,
        where: Callable[[ChunkKey], str | None],
        remote: str | None,
    ):
        self.events = events
        self._record_tokens = record_tokens
        self._gate = gate
        self._where = where
        self._remote = remote

    def in_memory(self, key: ChunkKey, tokens: ChunkTokens | None, memory: str) -> None:
        """``key`` became readable in memory: announced with ``tokens`` when it was not,
        else its medium is memory's again (it was only on disk or in Redis)."""
        events = self.events
        if events is None:
            return
        if tokens is not None:
            events.stored(key, tokens, memory)  # (nothing when announced already)
        if events.announced(key):
            events.moved(key, memory)  # (nothing when announced in memory)

    def unannounced(self, key: ChunkKey) -> bool:
        return self.events is not None and not self.events.announced(key)

    def tokens_of(self, key: ChunkKey) -> ChunkTokens | None:
        """The token ids a record of ``key`` carries (:mod:`..chunkfile`): those of an
        announced chunk, when ``record_tokens`` is on."""
        if self.events is None or not self._record_tokens:
            return None
        return self.events.tokens(key)

    def left_memory(self, key: ChunkKey) -> None:
        if self._gate is not None:
            self._gate.removed(key)
        self.left(key)

    def left(self, key: ChunkKey) -> None:
        """A tier dropped ``key``: announce it removed once no local tier holds it (moved
        to Redis when Redis is known to hold it), else where it now is (its medium
        changes when it leaves memory for the disk)."""
        events = self.events
        if events is not None and events.announced(key):
            where = self._where(key)
            if where is None and self._remote is not None and events.remote_holds(key):
                where = self._remote
            if where is None:
                events.removed(key)
            else:
                events.moved(key, where)
