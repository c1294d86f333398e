"""A get of many keys reads each lower tier for the whole batch at once (issue #15 item 2).

In-process, on a real pool, a real DiskTier in ``tmp_path`` and a real
redis-server (conftest): disk reads of one batch overlap (up to
``disk_io_threads``), Redis misses of one batch are one round trip (a
pipeline of GETs, each reply timed on its own), results keep the keys'
order, and a failure or a damaged file in a batch loses no lease and serves
the rest.  No assertion on time: the disk test counts reads in
flight at once.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio.connection

from lmcache_client.protocol import PutStatus
from lmcache_server.storage import ChunkKey, MemoryPool, MemoryTier, TieredStore, TierLinks
from lmcache_server.storage.disk import DiskTier
from lmcache_server.storage.disk import tier as disk_module
from lmcache_server.storage.disk.files import path_for, read_record
from lmcache_server.storage.remote import RemoteTier

from ..conftest import Closer, RedisServer
from ._slowlink import SlowLink

NS = "ns"
MiB = 1 << 20


def memory_tier(size: int = 64 * MiB, links: TierLinks | None = None) -> MemoryTier:
    return MemoryTier(MemoryPool(size, "off"), max_pinned_bytes=0, links=links)


def no_leaks(memory: MemoryTier) -> bool:
    """No lease held and no reservation left: every allocated byte is a visible, evictable chunk."""
    return memory.leased_chunks == 0 and memory.evictable_bytes == memory.allocator.allocated_bytes


class ReadsInFlight:
    """Wraps the disk tier's blocking record read (it runs on the I/O threads) and
    counts how many run at once.  Each read waits (at most ``wait_s``) for a second
    one to be in flight, so reads that overlap are seen to overlap, and reads run
    one after another are seen so too (each then waits in vain)."""

    def __init__(self, wait_s: float = 2.0, fail_for: set[str] | None = None):
        self.real = read_record
        self.wait_s = wait_s
        self.fail_for = fail_for or set()
        self.now = self.most = self.reads = 0
        self.lock = threading.Condition()

    def __call__(self, path: str, *args: Any) -> Any:
        with self.lock:
            self.now += 1
            self.reads += 1
            self.most = max(self.most, self.now)
            self.lock.notify_all()
            self.lock.wait_for(lambda: self.now >= 2, self.wait_s)
        try:
            if path in self.fail_for:
                raise RuntimeError("planted")
            return self.real(path, *args)
        finally:
            with self.lock:
                self.now -= 1


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[ReadsInFlight]:
    counter = ReadsInFlight()
    monkeypatch.setattr(disk_module, "read_record", counter)
    yield counter


async def disk_only(
    tmp_path: Path, data: list[bytes], io_threads: int = 2, links: TierLinks | None = None
) -> tuple[DiskTier, list[bytes]]:
    """An open disk tier holding ``data`` (and nothing in memory); their digests."""
    disk = DiskTier(tmp_path / "spill", 1 << 30, io_threads=io_threads, links=links)
    await disk.open()
    digests = [os.urandom(32) for _ in data]
    for digest, payload in zip(digests, data):
        assert await disk.put(ChunkKey(NS, digest), payload) is PutStatus.STORED
    return disk, digests


def test_disk_reads_of_a_batch_run_concurrently(
    tmp_path: Path, reads: ReadsInFlight, runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    async def scenario() -> None:
        data = [os.urandom(MiB + i) for i in range(6)]
        links = TierLinks(spill_ahead_bytes=0)  # a disk takes the spills
        disk, digests = await disk_only(tmp_path, data, io_threads=2, links=links)
        memory = memory_tier(links=links)
        store = closed_at_end(TieredStore(memory, disk, links=links))
        chunks = await store.get_many(NS, digests)
        assert [bytes(c.data) if c else None for c in chunks] == data  # in the order asked
        assert all(c is not None and c.offset is not None for c in chunks)  # promoted into the pool
        for c in chunks:
            assert c is not None
            c.release()
        assert reads.reads == 6 and reads.most >= 2
        assert no_leaks(memory) and memory.chunks == 6

    runner.run(scenario())


def test_one_failing_read_releases_the_rest_of_the_batch(
    tmp_path: Path, reads: ReadsInFlight, runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    async def scenario() -> None:
        data = [os.urandom(MiB) for _ in range(5)]
        links = TierLinks(spill_ahead_bytes=0)  # a disk takes the spills
        disk, digests = await disk_only(tmp_path, data, links=links)
        memory = memory_tier(links=links)
        store = closed_at_end(TieredStore(memory, disk, links=links))
        hot = os.urandom(32)
        assert await store.put_many(NS, [hot], [b"m" * MiB]) == [PutStatus.STORED]
        reads.fail_for = {path_for(disk.root, ChunkKey(NS, digests[2]))}
        with pytest.raises(RuntimeError, match="planted"):
            await store.get_many(NS, [hot, *digests])
        # The memory hit's lease and the other promotions' leases went back; the
        # failed read's room too.
        assert no_leaks(memory)
        assert memory.chunks == 1 + 4
        # The batch without the failing file is served whole.
        reads.fail_for = set()
        chunks = await store.get_many(NS, [hot, *digests])
        assert [bytes(c.data) if c else None for c in chunks] == [b"m" * MiB, *data]
        for c in chunks:
            assert c is not None
            c.release()
        assert no_leaks(memory)

    runner.run(scenario())


def test_a_damaged_file_in_a_batch_is_a_miss_and_the_rest_are_served(
    tmp_path: Path, reads: ReadsInFlight, runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    async def scenario() -> None:
        data = [os.urandom(MiB) for _ in range(5)]
        links = TierLinks(spill_ahead_bytes=0)  # a disk takes the spills
        disk, digests = await disk_only(tmp_path, data, links=links)
        path = path_for(disk.root, ChunkKey(NS, digests[1]))
        with open(path, "r+b") as f:  # one payload byte flipped
            f.seek(4096 + 1000)
            byte = f.read(1)
            f.seek(4096 + 1000)
            f.write(bytes([byte[0] ^ 0xFF]))
        memory = memory_tier(links=links)
        store = closed_at_end(TieredStore(memory, disk, links=links))
        chunks = await store.get_many(NS, digests)
        assert [bytes(c.data) if c else None for c in chunks] == [data[0], None, *data[2:]]
        for c in chunks:
            if c is not None:
                c.release()
        assert disk.counters.corrupt == 1 and not os.path.exists(path)  # removed, never served
        assert no_leaks(memory) and memory.chunks == 4

    runner.run(scenario())


def test_a_key_repeated_in_a_batch_is_served_each_time(
    tmp_path: Path, reads: ReadsInFlight, runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    async def scenario() -> None:
        reads.wait_s = 0.0
        data = [os.urandom(MiB), os.urandom(MiB)]
        links = TierLinks(spill_ahead_bytes=0)  # a disk takes the spills
        disk, (a, b) = await disk_only(tmp_path, data, links=links)
        memory = memory_tier(links=links)
        store = closed_at_end(TieredStore(memory, disk, links=links))
        chunks = await store.get_many(NS, [a, b, a, a])
        assert [bytes(c.data) if c else None for c in chunks] == [data[0], data[1], data[0], data[0]]
        assert reads.reads == 2  # the repeats are memory hits of the promoted chunk
        for c in chunks:
            assert c is not None
            c.release()
        assert no_leaks(memory)

    runner.run(scenario())


def test_a_disk_hit_with_no_room_in_the_pool_is_served_from_a_copy(
    tmp_path: Path, reads: ReadsInFlight, runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    async def scenario() -> None:
        reads.wait_s = 0.0
        data = [os.urandom(3 * MiB) for _ in range(3)]
        links = TierLinks(spill_ahead_bytes=0)  # a disk takes the spills
        disk, digests = await disk_only(tmp_path, data, links=links)
        memory = memory_tier(4 * MiB, links=links)  # room for one of them
        store = closed_at_end(TieredStore(memory, disk, links=links))
        chunks = await store.get_many(NS, digests)
        assert [bytes(c.data) if c else None for c in chunks] == data
        assert sum(c is not None and c.offset is not None for c in chunks) == 1  # one promoted
        for c in chunks:
            assert c is not None
            c.release()
        assert no_leaks(memory)

    runner.run(scenario())


# -- Redis ----------------------------------------------------------------------------------------
def command_calls(port: int) -> dict[str, int]:
    stats = redis.Redis(port=port).info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


async def redis_holding(url: str, data: list[bytes], links: TierLinks | None = None) -> tuple[RemoteTier, list[bytes]]:
    """An open Redis tier whose server holds ``data`` (written through the tier's own writer)."""
    remote = RemoteTier.redis(url, links=links)
    await remote.open()
    digests = [os.urandom(32) for _ in data]
    for digest, payload in zip(digests, data):
        assert remote.enqueue(ChunkKey(NS, digest), payload)
    assert await remote.flush(20)
    return remote, digests


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts redis-py's writes to a socket that carry GETs (one per command, one per
    pipeline): read round trips.  Writes of SETs (promoted chunks queued for Redis) are not."""
    count = [0]
    original = redis.asyncio.connection.AbstractConnection.send_packed_command

    async def counted(self: Any, command: Any, check_health: bool = True) -> None:
        pieces = [command] if isinstance(command, (bytes, str)) else command
        if any(b"\r\n$3\r\nGET\r\n" in bytes(p if not isinstance(p, str) else p.encode()) for p in pieces):
            count[0] += 1
        await original(self, command, check_health)

    monkeypatch.setattr(redis.asyncio.connection.AbstractConnection, "send_packed_command", counted)
    return count


def test_redis_hits_of_a_batch_are_one_round_trip(
    redis_server: RedisServer, sends: list[int], runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    async def scenario() -> None:
        data = [os.urandom(256 * 1024 + i) for i in range(8)]
        links = TierLinks()
        remote, digests = await redis_holding(redis_server.url, data, links=links)
        memory = memory_tier(links=links)
        store = closed_at_end(TieredStore(memory, None, remote, links=links))
        before = command_calls(redis_server.port)
        missing = os.urandom(32)
        sent = sends[0]
        chunks = await store.get_many(NS, [*digests[:4], missing, *digests[4:]])
        assert sends[0] - sent == 1  # nine GETs in one write
        after = command_calls(redis_server.port)
        assert [bytes(c.data) if c else None for c in chunks] == [*data[:4], None, *data[4:]]
        assert after.get("get", 0) - before.get("get", 0) == 9
        assert all(c is not None and c.offset is not None for c in chunks if c)  # promoted
        for c in chunks:
            if c is not None:
                c.release()
        assert no_leaks(memory) and store.promotions["redis"] == 8
        # Promoted: asked again, nothing goes to Redis.
        chunks = await store.get_many(NS, digests)
        assert [bytes(c.data) if c else None for c in chunks] == data
        for c in chunks:
            assert c is not None
            c.release()
        assert command_calls(redis_server.port).get("get", 0) == after.get("get", 0)

    runner.run(scenario())


def test_a_batch_over_memory_disk_and_redis_keeps_its_order(
    tmp_path: Path, redis_server: RedisServer, sends: list[int], runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    async def scenario() -> None:
        on_redis = [os.urandom(MiB) for _ in range(3)]
        links = TierLinks(spill_ahead_bytes=0)  # a disk takes the spills
        remote, redis_digests = await redis_holding(redis_server.url, on_redis, links=links)
        on_disk = [os.urandom(MiB) for _ in range(3)]
        disk, disk_digests = await disk_only(tmp_path, on_disk, links=links)
        memory = memory_tier(links=links)
        store = closed_at_end(TieredStore(memory, disk, remote, links=links))
        hot = os.urandom(32)
        assert await store.put_many(NS, [hot], [b"h" * 1000]) == [PutStatus.STORED]
        gone = os.urandom(32)
        order = [redis_digests[0], disk_digests[0], gone, hot, redis_digests[1], disk_digests[1],
                 disk_digests[2], redis_digests[2]]  # fmt: skip
        expect = [on_redis[0], on_disk[0], None, b"h" * 1000, on_redis[1], on_disk[1], on_disk[2], on_redis[2]]
        before, sent = command_calls(redis_server.port).get("get", 0), sends[0]
        chunks = await store.get_many(NS, order)
        assert [bytes(c.data) if c else None for c in chunks] == expect
        assert [c.tier if c else None for c in chunks] == ["memory"] * 2 + [None] + ["memory"] * 5
        # The batch's Redis misses (its three chunks and the key nobody holds): one round trip.
        assert command_calls(redis_server.port)["get"] - before == 4 and sends[0] - sent == 1
        for c in chunks:
            if c is not None:
                c.release()
        assert no_leaks(memory)
        assert store.promotions == {"disk": 3, "redis": 3}

    runner.run(scenario())


def test_a_read_that_fails_after_its_chunk_was_written_again_keeps_the_new_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    """A disk read in flight while its chunk is deleted and written again (same key,
    same size) fails on the old file; the chunk stored since stays, file and all."""

    async def scenario() -> None:
        data = [os.urandom(MiB)]
        disk, digests = await disk_only(tmp_path, data)
        closed_at_end(disk)
        key = ChunkKey(NS, digests[0])
        started, release = threading.Event(), threading.Event()
        real = disk_module.read_record

        def stalled(path: str, k: ChunkKey, out: Any = None, uncache: bool = False) -> Any:
            started.set()
            release.wait(10)
            raise FileNotFoundError(2, "No such file or directory", path)  # the old file is gone

        monkeypatch.setattr(disk_module, "read_record", stalled)
        reading = asyncio.ensure_future(disk.get(key))
        assert await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        assert await disk.delete(key)
        assert await disk.put(key, data[0]) is PutStatus.STORED  # written again, same size
        release.set()
        assert await reading is None  # the stale read is a miss
        monkeypatch.setattr(disk_module, "read_record", real)
        assert os.path.exists(path_for(disk.root, key))
        chunk = await disk.get(key)
        assert chunk is not None and bytes(chunk.data) == data[0]

    runner.run(scenario())


def test_damaged_redis_values_in_a_batch_are_misses(
    redis_server: RedisServer, runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    async def scenario() -> None:
        data = [os.urandom(100_000) for _ in range(4)]
        links = TierLinks()
        remote, digests = await redis_holding(redis_server.url, data, links=links)
        r = redis.Redis(port=redis_server.port)
        damaged = remote.remote_key(ChunkKey(NS, digests[2]))
        value = bytearray(bytes(r.get(damaged)))  # type: ignore[arg-type]
        value[-1] ^= 0xFF
        r.set(damaged, bytes(value))
        r.set(remote.remote_key(ChunkKey(NS, digests[3])), b"not a record")
        memory = memory_tier(links=links)
        store = closed_at_end(TieredStore(memory, None, remote, links=links))
        chunks = await store.get_many(NS, digests)
        assert [bytes(c.data) if c else None for c in chunks] == [data[0], data[1], None, None]
        for c in chunks:
            if c is not None:
                c.release()
        assert remote.counters.corrupt == 2 and not r.exists(damaged)
        assert no_leaks(memory)

    runner.run(scenario())


def test_a_redis_key_of_another_type_is_a_miss_left_alone(
    redis_server: RedisServer, runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    async def scenario() -> None:
        data = [os.urandom(100_000) for _ in range(3)]
        links = TierLinks()
        remote, digests = await redis_holding(redis_server.url, data, links=links)
        r = redis.Redis(port=redis_server.port)
        listed = remote.remote_key(ChunkKey(NS, digests[1]))
        r.delete(listed)
        r.rpush(listed, b"somebody else's list")  # GET answers WRONGTYPE
        memory = memory_tier(links=links)
        store = closed_at_end(TieredStore(memory, None, remote, links=links))
        chunks = await store.get_many(NS, digests)
        assert [bytes(c.data) if c else None for c in chunks] == [data[0], None, data[2]]
        for c in chunks:
            if c is not None:
                c.release()
        assert remote.up and remote.counters.read_errors == 1 and remote.counters.corrupt == 0
        assert r.type(listed) == b"list"  # not ours to delete
        assert no_leaks(memory)

    runner.run(scenario())


def test_a_batch_of_big_values_on_a_slow_link_is_not_an_outage(redis_server: RedisServer) -> None:
    """Eight 512 KiB values at 4 MiB/s: each reply takes ~0.13 s, the batch ~1 s, the
    timeout is 0.5 s.  Each reply is timed on its own, so the batch hits and the uplink
    stays up (one MGET reply of all eight would have timed out and marked it down)."""
    link = SlowLink(redis_server.port, down_rate=4 * MiB)

    async def scenario() -> None:
        data = [os.urandom(512 * 1024) for _ in range(8)]
        writer, digests = await redis_holding(redis_server.url, data)
        await writer.close()
        remote = RemoteTier.redis(f"redis://127.0.0.1:{link.port}", timeout_s=0.5)
        try:  # closed before the link (a fixture's teardown would come after it)
            await remote.open()
            assert remote.up
            chunks = await remote.get_many([ChunkKey(NS, d) for d in digests])
            assert [bytes(c.data) if c else None for c in chunks] == data
            assert remote.up and remote.counters.read_errors == 0 and remote.counters.hits == 8
        finally:
            await remote.close()

    try:
        asyncio.run(scenario())
    finally:
        link.close()


def test_writes_over_a_slow_link_shrink_their_pipelines_instead_of_going_down(redis_server: RedisServer) -> None:
    """Sixteen 1 MiB writes towards Redis at 8 MiB/s with a 0.5 s timeout: a pipeline
    of all of them cannot be sent in time (redis-py bounds the send of a whole
    pipeline by the timeout), so the writer halves its pipelines until they fit
    and sizes the next ones to the rate it saw; the uplink never goes down and
    every chunk lands (before, the timeout marked the uplink down and the same
    pipeline timed out again after every reconnect)."""
    link = SlowLink(redis_server.port, up_rate=8 * MiB)

    async def scenario() -> None:
        remote = RemoteTier.redis(f"redis://127.0.0.1:{link.port}", timeout_s=0.5)
        data = [os.urandom(MiB) for _ in range(16)]
        keys = [ChunkKey(NS, os.urandom(32)) for _ in data]
        try:  # closed before the link (a fixture's teardown would come after it)
            await remote.open()
            for key, payload in zip(keys, data):
                assert remote.enqueue(key, payload)
            assert await remote.flush(60)
            assert remote.up and remote.counters.reconnects == 0 and remote.counters.stores == 16
            assert remote.batch_bytes < 8 * MiB  # sized to the link
        finally:
            await remote.close()
        direct = RemoteTier.redis(redis_server.url)
        try:
            await direct.open()
            chunks = await direct.get_many(keys)
            assert [bytes(c.data) if c else None for c in chunks] == data
        finally:
            await direct.close()

    try:
        asyncio.run(scenario())
    finally:
        link.close()


def test_redis_cluster_batch_spans_slots(
    redis_cluster: list[RedisServer], runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    async def scenario() -> None:
        data = [os.urandom(50_000) for _ in range(12)]
        links = TierLinks()
        remote, digests = await redis_holding(f"redis+cluster://127.0.0.1:{redis_cluster[0].port}", data, links=links)
        memory = memory_tier(links=links)
        store = closed_at_end(TieredStore(memory, None, remote, links=links))
        chunks = await store.get_many(NS, digests)
        assert [bytes(c.data) if c else None for c in chunks] == data
        for c in chunks:
            assert c is not None
            c.release()
        assert no_leaks(memory)

    runner.run(scenario())
    per_node = [redis.Redis(port=n.port).dbsize() for n in redis_cluster]
    assert sum(1 for n in per_node if n) >= 2  # the batch did span nodes
