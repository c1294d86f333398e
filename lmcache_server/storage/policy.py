"""Eviction (and admission) policies of the memory tier.

The memory tier owns the bytes; a policy only orders keys.  Primitives:

- ``admit(key, size, parent)``: whether a new chunk deserves a slot at all
  (False -> the put answers SKIPPED).  ``parent`` is the key of the chunk
  before it in the same put request (its prefix), when known.
- ``inserted(key, size, parent)``, ``touched(key)`` (a hit), ``removed(key)``
  (deleted, evicted, or pinned and so no longer evictable).
- ``victim(skip)``: the key to evict next, never one for which ``skip(key)``
  is true (chunks being read); None when nothing is evictable.

Every call is O(1) or O(log n) amortised, except ``victim`` which may pass
over the (few) skipped keys.  Select one with ``cache_policy``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Protocol

from .base import ChunkKey


class EvictionPolicy(Protocol):
    name: str

    def admit(self, key: ChunkKey, size: int, parent: ChunkKey | None) -> bool: ...

    def inserted(self, key: ChunkKey, size: int, parent: ChunkKey | None) -> None: ...

    def touched(self, key: ChunkKey) -> None: ...

    def removed(self, key: ChunkKey) -> None: ...

    def victim(self, skip: Callable[[ChunkKey], bool]) -> ChunkKey | None: ...


class LRUPolicy:
    """Least recently used: O(1) per operation, 1 dict entry per chunk."""

    name = "lru"

    def __init__(self) -> None:
        self._order: collections.OrderedDict[ChunkKey, None] = collections.OrderedDict()

    def admit(self, key: ChunkKey, size: int, parent: ChunkKey | None) -> bool:
        return True

    def inserted(self, key: ChunkKey, size: int, parent: ChunkKey | None) -> None:
        self._order[key] = None

    def touched(self, key: ChunkKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def removed(self, key: ChunkKey) -> None:
        self._order.pop(key, None)

    def victim(self, skip: Callable[[ChunkKey], bool]) -> ChunkKey | None:
        for key in self._order:
            if not skip(key):
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown cache_policy {name!r}; known: {sorted(POLICIES)}") from None
