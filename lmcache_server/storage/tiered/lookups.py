"""The tiered store's lookups (:class:`Lookups`, a part of :class:`.store.TieredStore`):
which tier holds each key, without touching recency.

- The local tiers (memory, a chunk still filling counts as memory, then disk)
  are asked in one membership pass per tier over the keys still unplaced;
  Redis, for every key no local tier holds, in one round trip.
- ``lookup`` answers the leading-hit count and the fastest tier per key and
  counts it (:class:`LookupCounters`); ``lookup_now`` answers without waiting
  when no key needs Redis.
- With sizing telemetry on (``sizing``, :mod:`..sizing`), each lookup's keys are
  recorded in its ``lookup`` window, a memory hit being a key of the leading
  hit run found in memory.

Primitives: :class:`Lookups` (``where``, ``lookup``, ``lookup_now``, ``exists``), :class:`LookupCounters`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import cast

from ..base import ChunkKey
from ..sizing import Sizing
from .filling import Filling
from .roles import Tiers


@dataclasses.dataclass
class LookupCounters:
    lookups: int = 0
    chunks_asked: int = 0
    chunks_hit: int = 0


class Lookups:
    """Which tier holds each key; ``counters`` counts the lookups."""

    def __init__(self, tiers: Tiers, filling: Filling, sizing: Sizing | None):
        self.memory = tiers.memory
        self.remote = tiers.remote
        self.tiers = tiers.all
        self.filling = filling
        self.sizing = sizing
        self.counters = LookupCounters()

    def where(self, key: ChunkKey) -> str | None:
        """The fastest local tier holding ``key`` (None: none does)."""
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

    def _counted(
        self, namespace: str, digests: Sequence[bytes], tiers: list[str | None]
    ) -> tuple[int, list[str | None]]:
        hits = len(tiers) if None not in tiers else tiers.index(None)
        c = self.counters
        c.lookups += 1
        c.chunks_asked += len(tiers)
        c.chunks_hit += hits
        if self.sizing is not None:
            in_memory = list(map(self.memory.name.__eq__, tiers[:hits]))  # the leading run's memory hits
            in_memory += [False] * (len(tiers) - hits)
            self.sizing.lookup.record(namespace, digests, in_memory)
        return hits, tiers

    async def lookup(self, namespace: str, digests: Sequence[bytes]) -> tuple[int, list[str | None]]:
        """Leading-hit count and the fastest tier holding each key (None: not stored)."""
        return self._counted(namespace, digests, await self._locate(namespace, digests))

    def lookup_now(self, namespace: str, digests: Sequence[bytes]) -> tuple[int, list[str | None]] | None:
        """:meth:`lookup` answered without waiting, or None when it must ask Redis
        (some key is in no local tier and a remote tier is configured)."""
        tiers = self._locate_local(namespace, digests)
        if self.remote is not None and None in tiers:
            return None
        return self._counted(namespace, digests, tiers)

    async def exists(self, namespace: str, digests: Sequence[bytes]) -> list[bool]:
        return [t is not None for t in await self._locate(namespace, digests)]
