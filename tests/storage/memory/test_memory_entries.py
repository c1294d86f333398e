"""The memory tier keeps an unleased, unpinned chunk as one packed int in its index
(storage/memory/entry.py) and an entry object only while the chunk is leased,
pinned or dying; the accounting and the bytes are the same either way."""

from __future__ import annotations

import asyncio
import os

from lmcache_client.protocol import PutStatus
from lmcache_server.storage import ChunkKey, MemoryPool, MemoryTier
from lmcache_server.storage.memory.allocator import ALIGNMENT
from lmcache_server.storage.memory.entry import Entry
from lmcache_server.storage.policy import make_policy

from ...conftest import Closer

NS = "ns"


def tier_of(pages: int, policy: str = "lfuda") -> MemoryTier:
    pool = MemoryPool(pages * ALIGNMENT, "off")
    return MemoryTier(pool, 5 * ALIGNMENT // 2, make_policy(policy, pages * ALIGNMENT, 1))


def put(tier: MemoryTier, key: ChunkKey, data: bytes) -> None:
    assert asyncio.run(tier.put(key, data)) is PutStatus.STORED


def test_an_entry_is_an_object_only_while_leased_or_pinned(closed_at_end: Closer) -> None:
    tier = closed_at_end(tier_of(8))
    keys = [ChunkKey(NS, os.urandom(32)) for _ in range(3)]
    payloads = [os.urandom(ALIGNMENT + 100 * i) for i in range(3)]
    for key, data in zip(keys, payloads):
        put(tier, key, data)
    assert all(isinstance(tier.index.entries[k], int) for k in keys)
    first = asyncio.run(tier.get(keys[0]))
    second = tier.lease(keys[0])
    assert first is not None and second is not None and bytes(first.data) == payloads[0]
    assert isinstance(tier.index.entries[keys[0]], Entry) and tier.leased_chunks == 1
    first.release()
    assert isinstance(tier.index.entries[keys[0]], Entry)  # still leased once
    second.release()
    assert isinstance(tier.index.entries[keys[0]], int) and tier.leased_chunks == 0
    assert tier.evictable_bytes == tier.allocator.allocated_bytes
    assert tier.pin(keys[1]) and isinstance(tier.index.entries[keys[1]], Entry)
    assert tier.pin(keys[1]) and tier.pinned_bytes == 2 * ALIGNMENT  # its extent: ALIGNMENT + 100 bytes hold 2 pages
    assert not tier.pin(keys[2])  # over max_pinned_bytes: stays packed
    assert isinstance(tier.index.entries[keys[2]], int)
    assert tier.unpin(keys[1]) and isinstance(tier.index.entries[keys[1]], int) and tier.pinned_bytes == 0
    assert not tier.unpin(keys[1])
    for key, data in zip(keys, payloads):
        chunk = asyncio.run(tier.get(key))
        assert chunk is not None and bytes(chunk.data) == data
        chunk.release()
    assert tier.stored_bytes == sum(map(len, payloads))


def test_a_chunk_deleted_while_leased_frees_its_extent_at_the_release(closed_at_end: Closer) -> None:
    tier = closed_at_end(tier_of(4))
    key = ChunkKey(NS, os.urandom(32))
    put(tier, key, os.urandom(3 * ALIGNMENT))
    chunk = tier.lease(key)
    assert chunk is not None
    assert asyncio.run(tier.delete(key)) and not tier.peek(key)
    assert tier.dying_bytes == 3 * ALIGNMENT and tier.allocator.allocated_bytes == 3 * ALIGNMENT
    chunk.release()
    assert tier.dying_bytes == 0 and tier.allocator.allocated_bytes == 0 and tier.allocator.free_extents == 1


def test_eviction_and_snapshot_see_packed_and_object_entries_alike(closed_at_end: Closer) -> None:
    tier = closed_at_end(tier_of(4, "lru"))  # registered alone: the fresh tier below shares its pool
    keys = [ChunkKey(NS, os.urandom(32)) for _ in range(6)]
    put(tier, keys[0], b"a" * ALIGNMENT)
    held = tier.lease(keys[0])  # an object: leased, never a victim
    for key in keys[1:4]:
        put(tier, key, b"b" * ALIGNMENT)
    assert tier.pin(keys[3])
    put(tier, keys[4], b"c" * ALIGNMENT)  # evicts keys[1], the oldest unleased unpinned
    assert not tier.peek(keys[1]) and tier.peek(keys[0]) and tier.counters.evictions == 1
    rows = tier.snapshot()
    assert [r[0] for r in rows] == [keys[0], keys[2], keys[4], keys[3]]
    assert rows[-1][3] is True and all(r[2] == ALIGNMENT for r in rows)
    assert held is not None
    held.release()
    fresh = MemoryTier(tier.pool, 5 * ALIGNMENT // 2, make_policy("lru", 4 * ALIGNMENT, 1))
    fresh.adopt(rows, [])
    assert fresh.snapshot() == rows and fresh.pinned_bytes == ALIGNMENT
    assert fresh.allocator.allocated_bytes == 4 * ALIGNMENT and fresh.evictable_bytes == 3 * ALIGNMENT
