"""Policies that exist only in the simulation: published baselines and offline oracles.

They implement the daemon's policy interface
(:class:`lmcache_server.storage.policy.EvictionPolicy`: admit / inserted /
touched / removed / victim / order) so that ``policy_sim.CacheModel`` drives
them exactly as it drives the daemon's own classes.  The daemon does not ship
them (``cache_policy`` offers lru, lfuda and adaptive); they are the yardsticks.

- ``arc``: Adaptive Replacement Cache (Megiddo & Modha, FAST'03): a recency
  list T1 and a frequency list T2, ghost lists B1 / B2 of the keys they
  evicted, and a target size ``p`` for T1 moved by ghost hits.  A chunk
  coming back from a ghost list enters T2.
- ``s3fifo``: S3-FIFO (Yang et al., SOSP'23): a small FIFO (10% of the
  capacity) for new chunks, a main FIFO, a ghost FIFO of the keys the small
  queue evicted (as many as the main queue's share of the capacity).  A chunk read while in the
  small queue (frequency >= 1) moves to main when it reaches the small queue's
  end, else it leaves and its key goes to the ghost; a chunk in the ghost
  enters main directly.  Main is FIFO with reinsertion: a chunk with
  frequency > 0 is put back with one less (frequency caps at 3).
- ``oracle-reuse-lru``, ``oracle-count``: the offline bounds of policy_sim.

Capacity is in chunks (the simulation's chunks are one size).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable

from lmcache_server.storage.base import ChunkKey
from lmcache_server.storage.policy import EvictionPolicy, LRUPolicy


class ARCPolicy:
    """Adaptive Replacement Cache for a tier of ``capacity`` chunks."""

    name = "arc"

    def __init__(self, capacity: int):
        self.c = max(1, capacity)
        self.p = 0.0  # target size of T1
        self.t1: OrderedDict[ChunkKey, None] = OrderedDict()
        self.t2: OrderedDict[ChunkKey, None] = OrderedDict()
        self.b1: OrderedDict[ChunkKey, None] = OrderedDict()
        self.b2: OrderedDict[ChunkKey, None] = OrderedDict()
        self._pending_in_b2 = False  # the key being admitted was in B2 (REPLACE's tie rule)

    def admit(self, key: ChunkKey, size: int, parent: ChunkKey | None) -> bool:
        self._pending_in_b2 = key in self.b2
        if key in self.b1:
            self.p = min(float(self.c), self.p + max(len(self.b2) / len(self.b1), 1.0))
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
        return True

    def inserted(self, key: ChunkKey, size: int, parent: ChunkKey | None) -> None:
        if self.b1.pop(key, 0) is None or self.b2.pop(key, 0) is None:
            self.t2[key] = None  # seen before: frequent
        else:
            self.t1[key] = None
        while len(self.t1) + len(self.b1) > self.c and self.b1:
            self.b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.c and self.b2:
            self.b2.popitem(last=False)

    def touched(self, key: ChunkKey) -> None:
        if self.t1.pop(key, 0) is None or key in self.t2:
            self.t2[key] = None
            self.t2.move_to_end(key)

    def removed(self, key: ChunkKey) -> None:
        if self.t1.pop(key, 0) is None:
            self.b1[key] = None
        elif self.t2.pop(key, 0) is None:
            self.b2[key] = None

    def victim(self, skip: Callable[[ChunkKey], bool]) -> ChunkKey | None:
        t1_first = bool(self.t1) and (len(self.t1) > self.p or (self._pending_in_b2 and len(self.t1) >= self.p))
        lists = (self.t1, self.t2) if t1_first or not self.t2 else (self.t2, self.t1)
        for lst in lists:
            for key in lst:
                if not skip(key):
                    return key
        return None

    def order(self) -> list[ChunkKey]:
        return [*self.t1, *self.t2]


class S3FIFOPolicy:
    """S3-FIFO for a tier of ``capacity`` chunks (small queue: ``small_fraction`` of it)."""

    name = "s3fifo"

    def __init__(self, capacity: int, small_fraction: float = 0.1):
        self.c = max(1, capacity)
        self.small_target = max(1, int(self.c * small_fraction))
        self.small: OrderedDict[ChunkKey, None] = OrderedDict()
        self.main: OrderedDict[ChunkKey, None] = OrderedDict()
        self.ghost: OrderedDict[ChunkKey, None] = OrderedDict()
        self.freq: dict[ChunkKey, int] = {}

    def admit(self, key: ChunkKey, size: int, parent: ChunkKey | None) -> bool:
        return True

    def inserted(self, key: ChunkKey, size: int, parent: ChunkKey | None) -> None:
        self.freq[key] = 0
        if self.ghost.pop(key, 0) is None:
            self.main[key] = None
        else:
            self.small[key] = None

    def touched(self, key: ChunkKey) -> None:
        if key in self.freq:
            self.freq[key] = min(3, self.freq[key] + 1)

    def removed(self, key: ChunkKey) -> None:
        self.freq.pop(key, None)
        if self.small.pop(key, 0) is None:
            self.ghost[key] = None
            while len(self.ghost) > max(1, self.c - self.small_target):
                self.ghost.popitem(last=False)
        else:
            self.main.pop(key, None)

    def victim(self, skip: Callable[[ChunkKey], bool]) -> ChunkKey | None:
        """The next chunk to leave; promotes and reinserts on the way, as S3-FIFO's eviction does."""
        for _ in range(4 * (len(self.small) + len(self.main)) + 1):
            if self.small and (len(self.small) >= self.small_target or not self.main):
                key = next(iter(self.small))
                if self.freq[key] >= 1:
                    del self.small[key]
                    self.main[key] = None
                    self.freq[key] = 0
                    continue
            elif self.main:
                key = next(iter(self.main))
                if self.freq[key] > 0:
                    self.freq[key] -= 1
                    self.main.move_to_end(key)
                    continue
            else:
                return None
            if not skip(key):
                return key
            (self.small if key in self.small else self.main).move_to_end(key)
        return None

    def order(self) -> list[ChunkKey]:
        return [*self.small, *self.main]


class ReuseOracleLRU(LRUPolicy):
    """Offline bound: LRU that admits a block only if the trace accesses it again."""

    name = "oracle-reuse-lru"

    def __init__(self, remaining: dict[ChunkKey, int]):
        super().__init__()
        self.remaining = remaining  # accesses still to come, this one included

    def admit(self, key: ChunkKey, size: int, parent: ChunkKey | None) -> bool:
        self.remaining[key] -= 1
        return self.remaining[key] > 0

    def touched(self, key: ChunkKey) -> None:
        self.remaining[key] -= 1
        super().touched(key)


class CountOracle:
    """Offline bound: evict the block with the fewest accesses still to come (ties: LRU).
    Knows how often, not when: the ideal of any frequency-based policy."""

    name = "oracle-count"

    def __init__(self, remaining: dict[ChunkKey, int]):
        self.remaining = remaining
        self.rank: dict[ChunkKey, tuple[int, int]] = {}
        self.heap: list[tuple[int, int, ChunkKey]] = []
        self.clock = 0

    def admit(self, key: ChunkKey, size: int, parent: ChunkKey | None) -> bool:
        self.remaining[key] -= 1
        return True

    def _push(self, key: ChunkKey) -> None:
        self.clock += 1
        self.rank[key] = (self.remaining[key], self.clock)
        heapq.heappush(self.heap, (*self.rank[key], key))

    def inserted(self, key: ChunkKey, size: int, parent: ChunkKey | None) -> None:
        self._push(key)

    def touched(self, key: ChunkKey) -> None:
        self.remaining[key] -= 1
        self._push(key)

    def removed(self, key: ChunkKey) -> None:
        self.rank.pop(key, None)

    def victim(self, skip: Callable[[ChunkKey], bool]) -> ChunkKey | None:
        while self.heap:
            remaining, clock, key = self.heap[0]
            if self.rank.get(key) == (remaining, clock):
                return key
            heapq.heappop(self.heap)
        return None

    def order(self) -> list[ChunkKey]:
        return sorted(self.rank, key=self.rank.__getitem__)


BASELINES: dict[str, Callable[[int], EvictionPolicy]] = {"arc": ARCPolicy, "s3fifo": S3FIFOPolicy}
"""Published policies, by name: ``capacity (chunks) -> policy``."""

ORACLES: dict[str, Callable[[dict[ChunkKey, int]], EvictionPolicy]] = {
    "oracle-reuse-lru": ReuseOracleLRU,
    "oracle-count": CountOracle,
}
"""Offline bounds, by name: ``accesses still to come per key -> policy``."""
