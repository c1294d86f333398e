"""Eviction (and admission) policies of the memory and disk tiers.

A tier owns the bytes; a policy only orders keys.  Primitives:

- ``admit(key, size, parent)``: whether a new chunk deserves a slot at all
  (False -> the put answers SKIPPED).  ``parent`` is the key of the chunk
  before it in the same put request (its prefix), when known.  The memory
  tier admits a put's new chunks in order and one put at a time (the tiered
  store reserves them together), so a chunk admitted with no parent starts
  a new put.
- ``inserted(key, size, parent)``, ``touched(key)`` (a hit), ``removed(key)``
  (deleted, evicted, or pinned and so no longer evictable).
- ``victim(skip)``: the key to evict next, never one for which ``skip(key)``
  is true (chunks being read); None when nothing is evictable.  It only
  names the victim: the tier evicts it and then calls ``removed``.
- ``order()``: every key it orders, next victim first (what a warm restart
  keeps: inserting them again in this order gives back the same order,
  frequencies aside).

Every call is O(1) or O(log n) amortised, except ``victim`` which may pass
over the (few) skipped keys.  Select one with ``cache_policy`` (the package's
:func:`make_policy`):

- ``lru``: least recently used (:mod:`.lru`).
- ``lfuda``: LFU with dynamic aging, a bounded frequency history of evicted
  keys, prefix-aware tie-breaking and put tails ranked lower (:mod:`.lfuda`).
- ``adaptive``: lfuda's order plus an admission rule switched on only while
  it pays (:mod:`.adaptive`); the default, see ``docs/eviction.md`` for why
  and for the figures on a production trace.

This module holds the interface, :class:`EvictionPolicy`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..base import ChunkKey


class EvictionPolicy(Protocol):
    name: str

    def admit(self, key: ChunkKey, size: int, parent: ChunkKey | None) -> bool: ...

    def inserted(self, key: ChunkKey, size: int, parent: ChunkKey | None) -> None: ...

    def touched(self, key: ChunkKey) -> None: ...

    def removed(self, key: ChunkKey) -> None: ...

    def victim(self, skip: Callable[[ChunkKey], bool]) -> ChunkKey | None: ...

    def order(self) -> list[ChunkKey]: ...
