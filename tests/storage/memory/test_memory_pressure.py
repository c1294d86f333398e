"""A put under pressure costs the same at 1,000 and 100,000 chunks while chunks
are leased (issue #14 item 9): counted in operations, not timed.

Whether evicting can make room at all used to be a scan of the whole index
(``allocator.size_of`` per chunk) whenever any chunk was leased; now the memory
tier keeps ``evictable_bytes`` current.  benchmarks/bench_put_pressure.py shows
the same in microseconds.
"""

from __future__ import annotations

import os

import pytest

from lmcache_client.protocol import PutStatus
from lmcache_server.storage import ChunkKey, MemoryPool, MemoryTier
from lmcache_server.storage.memory import Reservation
from lmcache_server.storage.memory.allocator import ALIGNMENT
from lmcache_server.storage.policy import make_policy

from ...conftest import Closer

NS = "ns"


def full_tier(closed_at_end: Closer, chunks: int, policy: str) -> tuple[MemoryTier, list[ChunkKey]]:
    """A tier whose pool is exactly full of ``chunks`` one-page chunks (never
    written: their pages stay untouched), with two of them leased; closed at the test's end."""
    tier = closed_at_end(
        MemoryTier(MemoryPool(chunks * ALIGNMENT, "off"), 0, make_policy(policy, chunks * ALIGNMENT, ALIGNMENT))
    )
    keys = [ChunkKey(NS, os.urandom(32)) for _ in range(chunks)]
    for key in keys:
        reservation = tier.reserve(key, ALIGNMENT)
        assert isinstance(reservation, Reservation)
        assert tier.commit(reservation) is PutStatus.STORED
    assert tier.allocator.free_bytes == 0
    return tier, keys


def extent_lookups_of_one_put(closed_at_end: Closer, chunks: int, policy: str) -> int:
    tier, keys = full_tier(closed_at_end, chunks, policy)
    leases = [tier.lease(keys[0]), tier.lease(keys[-1])]  # the oldest and the newest
    assert tier.leased_chunks == 2
    calls = [0]
    size_of = tier.allocator.size_of

    def counting(offset: int) -> int:
        calls[0] += 1
        return size_of(offset)

    tier.allocator.size_of = counting  # type: ignore[method-assign]
    reservation = tier.reserve(ChunkKey(NS, os.urandom(32)), ALIGNMENT)
    assert isinstance(reservation, Reservation)  # room was made by evicting one chunk
    assert tier.commit(reservation) is PutStatus.STORED
    assert tier.counters.evictions == 1
    for lease in leases:
        assert lease is not None
        lease.release()
    assert tier.evictable_bytes == tier.allocator.allocated_bytes  # nothing leased or pinned now
    return calls[0]


@pytest.mark.parametrize("policy", ["lru", "lfuda", "adaptive"])
def test_put_under_pressure_is_constant_in_the_number_of_chunks(policy: str, closed_at_end: Closer) -> None:
    small = extent_lookups_of_one_put(closed_at_end, 1_000, policy)
    large = extent_lookups_of_one_put(closed_at_end, 100_000, policy)
    assert large == small <= 4


def test_evictable_bytes_follows_leases_pins_and_removals(closed_at_end: Closer) -> None:
    tier, keys = full_tier(closed_at_end, 8, "lru")
    tier.index.max_pinned_bytes = 8 * ALIGNMENT
    total = 8 * ALIGNMENT
    assert tier.evictable_bytes == total
    lease = tier.lease(keys[0])
    assert lease is not None and tier.evictable_bytes == total - ALIGNMENT
    assert tier.pin(keys[0]) and tier.pin(keys[1])
    assert tier.evictable_bytes == total - 2 * ALIGNMENT
    lease.release()  # still pinned: still not evictable
    assert tier.evictable_bytes == total - 2 * ALIGNMENT
    assert tier.unpin(keys[0])
    assert tier.evictable_bytes == total - ALIGNMENT
    leased = tier.lease(keys[2])
    assert leased is not None
    tier.index.remove(tier.index.entries[keys[2]])  # deleted while leased: dying, not evictable
    assert tier.evictable_bytes == total - 2 * ALIGNMENT
    leased.release()
    assert tier.evictable_bytes == total - 2 * ALIGNMENT  # its extent went back to the allocator
    assert tier.allocator.free_bytes == ALIGNMENT
