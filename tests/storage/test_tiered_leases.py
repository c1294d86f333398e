"""The tiered store never leaks a lease or a reservation (issue #14 item 7).

In-process, on a real pool and memory tier; the lower tiers are fakes through
the tier interface (a tier that fails, a disk whose read is slow), which is
what these paths are about.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import pytest

from lmcache_client.protocol import PutStatus
from lmcache_server.storage import Chunk, ChunkKey, MemoryPool, MemoryTier, TieredStore, TierLinks

from ..conftest import Closer

NS = "ns"
MiB = 1 << 20


def memory_tier(size: int = 16 * MiB, links: TierLinks | None = None) -> MemoryTier:
    return MemoryTier(MemoryPool(size, "off"), max_pinned_bytes=0, links=links)


class FailingTier:
    """A lower tier whose reads raise (a bug, or a client library surprised by a reply)."""

    name = "redis"

    async def get(self, key: ChunkKey) -> Chunk | None:
        raise TypeError("memoryview: a bytes-like object is required, not 'int'")

    async def get_many(self, keys: list[ChunkKey]) -> list[Chunk | None]:
        raise TypeError("memoryview: a bytes-like object is required, not 'int'")

    def peek(self, key: ChunkKey) -> bool:
        return False

    def peek_many(self, keys: list[ChunkKey]) -> list[bool]:
        return [False] * len(keys)

    def enqueue(self, key: ChunkKey, data: Any, release: Any = None) -> bool:
        if release is not None:
            release()
        return False

    async def close(self) -> None:
        pass


class SlowDisk:
    """A disk tier holding every key, whose read into the pool waits for ``go``
    in another thread (as the real one reads on its I/O threads)."""

    name = "disk"

    def __init__(self, size: int):
        self.size = size
        self.started = threading.Event()
        self.go = threading.Event()
        self.finished = threading.Event()

    def payload_size(self, key: ChunkKey) -> int:
        return self.size

    def peek(self, key: ChunkKey) -> bool:
        return True

    def peek_many(self, keys: list[ChunkKey]) -> list[bool]:
        return [True] * len(keys)

    def _read(self, out: memoryview) -> None:
        self.started.set()
        self.go.wait(30)
        out[:] = b"d" * out.nbytes  # writes into the reservation, as a disk read does
        self.finished.set()

    async def get(self, key: ChunkKey, out: memoryview | None = None) -> Chunk | None:
        assert out is not None
        await asyncio.get_running_loop().run_in_executor(None, self._read, out)
        return Chunk(out, self.name)

    async def close(self) -> None:
        pass


def test_a_failing_tier_read_releases_the_leases_of_earlier_hits(runner: asyncio.Runner, closed_at_end: Closer) -> None:
    async def scenario() -> None:
        links = TierLinks()
        memory = memory_tier(links=links)
        store = closed_at_end(TieredStore(memory, None, FailingTier(), links=links))  # type: ignore[arg-type]
        hit, miss = os.urandom(32), os.urandom(32)
        assert await store.put_many(NS, [hit], [b"h" * MiB]) == [PutStatus.STORED]
        with pytest.raises(TypeError):
            await store.get_many(NS, [hit, miss])
        assert memory.leased_chunks == 0  # the hit's lease went back
        assert memory.evictable_bytes == memory.allocator.allocated_bytes

    runner.run(scenario())


def test_a_cancelled_promotion_frees_its_room_only_after_the_disk_read_ends(
    runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    async def scenario() -> None:
        links = TierLinks(spill_ahead_bytes=0)  # a disk takes the spills
        memory = memory_tier(links=links)
        disk = SlowDisk(2 * MiB)
        store = closed_at_end(TieredStore(memory, disk, links=links))  # type: ignore[arg-type]
        before = memory.allocator.allocated_bytes
        reader = asyncio.create_task(store.get_many(NS, [os.urandom(32)]))
        await asyncio.get_running_loop().run_in_executor(None, disk.started.wait, 30)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        # The thread still writes into the room: it must not be handed to anyone else yet.
        assert memory.allocator.allocated_bytes == before + 2 * MiB
        other = memory.reserve(ChunkKey(NS, os.urandom(32)), 15 * MiB)
        assert other is PutStatus.NO_SPACE
        disk.go.set()
        await asyncio.get_running_loop().run_in_executor(None, disk.finished.wait, 30)
        for _ in range(100):  # the read's done-callback runs on a later loop step
            if memory.allocator.allocated_bytes == before:
                break
            await asyncio.sleep(0.01)
        assert memory.allocator.allocated_bytes == before
        assert memory.chunks == 0 and memory.leased_chunks == 0  # never made visible

    runner.run(scenario())


def test_a_failed_promotion_gives_its_room_back(runner: asyncio.Runner, closed_at_end: Closer) -> None:
    class BrokenDisk(SlowDisk):
        async def get(self, key: ChunkKey, out: memoryview | None = None) -> Chunk | None:
            raise RuntimeError("planted")

    async def scenario() -> Any:
        links = TierLinks(spill_ahead_bytes=0)
        memory = memory_tier(links=links)
        store = closed_at_end(TieredStore(memory, BrokenDisk(MiB), links=links))  # type: ignore[arg-type]
        with pytest.raises(RuntimeError):
            await store.get_many(NS, [os.urandom(32)])
        assert memory.allocator.allocated_bytes == 0 and memory.leased_chunks == 0

    runner.run(scenario())
