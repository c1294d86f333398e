"""The ``lru`` eviction policy: least recently used (:class:`.base.EvictionPolicy`).

Primitives: :class:`LRUPolicy`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from ..base import ChunkKey


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

    def order(self) -> list[ChunkKey]:
        return list(self._order)

    def __len__(self) -> int:
        return len(self._order)
