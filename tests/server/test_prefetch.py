"""Prefetch while parked (issue 30 item 5): a lookup with ``prefetch: true`` promotes the
leading hits that sit on disk or in Redis into memory after its reply (docs/protocol.md 5.5).

Through the real daemon (its process, its sockets): chunks are parked on disk by
evicting them from a small memory tier and restarting the daemon (warm_restart is off
in tests: memory starts empty, the disk index is rebuilt), or in Redis by restarting a
daemon without a disk.  The prefetcher's own bounds (one prefetch per key, close) are
also driven in-process on a real store over a disk whose reads wait for the test.
Nothing here asserts on wall-clock time: progress is polled with ``wait_for``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import zmq

from lmcache_client import PutStatus
from lmcache_client.calls import lookup as calls_lookup
from lmcache_client.protocol import KEY_BYTES, PROTOCOL_VERSION, ErrorCode
from lmcache_server.server.inflight import ByteBudget
from lmcache_server.server.prefetch import Prefetcher, owner_of
from lmcache_server.storage import ChunkKey, TieredStore, TierLinks

from ..conftest import NAMESPACE, Closer, Daemon, RedisServer, disk_stats, wait_for
from ..metrics.test_metrics import sample, scrape
from ..storage._slowlink import SlowLink
from ..storage.test_tiered_leases import SlowDisk, memory_tier

KiB = 1 << 10
MiB = 1 << 20


def park_on_disk(daemon: Daemon, sizes: list[int], filler: int = 512 * KiB) -> tuple[list[bytes], list[bytes]]:
    """Chunks of ``sizes`` that only the disk holds: put, pushed out of the 8 MiB
    memory tier (cache_policy lru) by fillers, spilled, then the daemon restarted."""
    keys = [os.urandom(KEY_BYTES) for _ in sizes]
    data = [os.urandom(size) for size in sizes]
    with daemon.client() as c:
        for k, d in zip(keys, data):
            assert c.put([k], [d]) == [PutStatus.STORED]
        for _ in range(9 * MiB // filler + 1):
            assert c.put([os.urandom(KEY_BYTES)], [os.urandom(filler)]) == [PutStatus.STORED]
        wait_for(lambda: c.lookup(keys).tiers == ["disk"] * len(keys) and disk_stats(c)["queued_spills"] == 0)
    assert daemon.stop() == 0
    daemon.start()
    return keys, data


def prefetch_stats(c: Any) -> dict[str, Any]:
    return dict(c.stats()["prefetch"])


def settled(c: Any, chunks: int) -> dict[str, Any]:
    """The prefetch stats once ``chunks`` chunks were prefetched and no prefetch runs."""
    return dict(wait_for(lambda: (s := prefetch_stats(c))["prefetched_chunks"] >= chunks and not s["running"] and s))


def raw_lookup(daemon: Daemon, keys: list[bytes], **fields: Any) -> dict[str, Any]:
    """One lookup sent by hand (fields as given, e.g. a bad ``prefetch``); its reply header."""
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(daemon.address)
        header = {"v": PROTOCOL_VERSION, "op": "lookup", "id": 77, "ns": NAMESPACE, "keys": keys, **fields}
        sock.send(msgpack.packb(header, use_bin_type=True))
        assert sock.poll(10_000, zmq.POLLIN), "no reply"
        frames = sock.recv_multipart()
        assert len(frames) == 1
        reply: dict[str, Any] = msgpack.unpackb(frames[0], raw=False)
        return reply
    finally:
        ctx.destroy(linger=0)


# -- through the daemon --------------------------------------------------------------------
def test_lookup_with_prefetch_moves_the_leading_disk_hits_into_memory(disk_daemon: Any) -> None:
    daemon = disk_daemon(cache_policy="lru")
    keys, data = park_on_disk(daemon, [MiB] * 4)
    asked = [*keys[:2], os.urandom(KEY_BYTES), *keys[2:]]  # a miss after two hits
    with daemon.client() as c:
        assert c.hello()["prefetch"] is True
        assert c.lookup(asked).tiers == ["disk", "disk", None, "disk", "disk"]
        # The reply is the lookup as found: the prefetch starts after it.
        result = c.lookup(asked, prefetch=True)
        assert (result.hit_chunks, result.tiers) == (2, ["disk", "disk", None, "disk", "disk"])
        wait_for(lambda: c.lookup(keys[:2]).tiers == ["memory", "memory"])
        stats = settled(c, 2)
        assert stats == {
            "prefetches": 1,
            "prefetched_chunks": 2,
            "prefetched_bytes": 2 * MiB,
            "declined": 0,
            "cancelled": 0,
            "running": 0,
            "held_bytes": 0,
        }
        assert c.lookup(keys[2:]).tiers == ["disk", "disk"]  # past the first miss: of no use, left alone
        assert c.stats()["tiers"]["disk"]["promotions"] == 2
        assert c.stats()["server"]["inflight_bytes"] == 0
        # The load that follows is a memory hit.
        disk_hits, memory_hits = disk_stats(c)["hits"], c.stats()["tiers"]["memory"]["hits"]
        assert [bytes(g) for g in c.get(keys[:2])] == data[:2]
        assert disk_stats(c)["hits"] == disk_hits
        assert c.stats()["tiers"]["memory"]["hits"] == memory_hits + 2
    text = scrape(daemon.metrics_port)
    assert sample(text, "lmcache_prefetches_total") == 1.0
    assert sample(text, "lmcache_prefetched_chunks_total") == 2.0
    assert sample(text, "lmcache_prefetched_bytes_total") == 2.0 * MiB
    assert sample(text, "lmcache_prefetches_declined_total") == 0.0
    assert sample(text, "lmcache_prefetch_held_bytes") == 0.0


def test_lookup_without_prefetch_promotes_nothing(disk_daemon: Any) -> None:
    daemon = disk_daemon(cache_policy="lru")
    keys, _ = park_on_disk(daemon, [MiB] * 4)
    with daemon.client() as c:
        for _ in range(3):
            assert c.lookup(keys[:3]).tiers == ["disk"] * 3
            assert raw_lookup(daemon, keys[:3], prefetch=False)["tiers"] == ["disk"] * 3
            assert raw_lookup(daemon, keys[:3], prefetch=None)["tiers"] == ["disk"] * 3  # nil: absent
        # A prefetch asked after them, as a marker: once it is done, whatever those
        # lookups had started would have run too.
        c.lookup(keys[3:], prefetch=True)
        assert settled(c, 1)["prefetched_chunks"] == 1
        assert c.lookup(keys).tiers == ["disk", "disk", "disk", "memory"]
        assert c.stats()["tiers"]["disk"]["promotions"] == 1


def test_a_prefetch_the_budget_cannot_cover_is_declined(disk_daemon: Any) -> None:
    # Prefetches hold at most half of the in-flight budget (512 KiB here), in windows.
    daemon = disk_daemon(cache_policy="lru", max_inflight_bytes="1MiB", max_message_size="1MiB")
    keys, _ = park_on_disk(daemon, [256 * KiB] * 4 + [768 * KiB])
    small, big = keys[:4], keys[4:]
    with daemon.client() as c:
        c.lookup(small, prefetch=True)  # 1 MiB: two windows of 512 KiB
        wait_for(lambda: c.lookup(small).tiers == ["memory"] * 4)
        assert settled(c, 4)["prefetched_bytes"] == MiB
        c.lookup(big, prefetch=True)  # one chunk larger than half the budget
        stats = wait_for(lambda: (s := prefetch_stats(c))["declined"] == 1 and not s["running"] and s)
        assert (stats["prefetches"], stats["prefetched_chunks"], stats["held_bytes"]) == (1, 4, 0)
        assert c.lookup(big).tiers == ["disk"]
        assert c.stats()["server"]["inflight_bytes"] == 0
        # Declined is only skipped: the chunk is still served, from disk.
        assert c.get(big)[0] is not None
    text = scrape(daemon.metrics_port)
    assert sample(text, "lmcache_prefetches_declined_total") == 1.0
    assert sample(text, "lmcache_prefetched_chunks_total") == 4.0


def test_lookups_of_the_same_keys_promote_each_chunk_once(disk_daemon: Any) -> None:
    daemon = disk_daemon(cache_policy="lru")
    keys, _ = park_on_disk(daemon, [MiB] * 3)
    header = {"v": PROTOCOL_VERSION, "op": "lookup", "ns": NAMESPACE, "keys": keys, "prefetch": True}
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(daemon.address)
        for i in range(8):  # pipelined: later ones arrive while the first prefetch runs, or after it
            sock.send(msgpack.packb({**header, "id": i}, use_bin_type=True))
        for _ in range(8):
            assert sock.poll(10_000, zmq.POLLIN), "no reply"
            reply = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
            assert reply["ok"] is True and reply["hits"] == 3
    finally:
        ctx.destroy(linger=0)
    with daemon.client() as c:
        stats = settled(c, 3)
        # Keys a running prefetch holds are left out of a new one; keys memory holds need none.
        assert (stats["prefetches"], stats["prefetched_chunks"], stats["declined"]) == (1, 3, 0)
        assert c.stats()["tiers"]["disk"]["promotions"] == 3
        assert c.lookup(keys).tiers == ["memory"] * 3


@pytest.fixture(scope="module")
def plain_daemon(module_daemon_factory: Callable[..., Daemon]) -> Daemon:
    """One daemon (memory only) for the module's bad-input tests: each proves it still serves."""
    return module_daemon_factory()


@pytest.mark.parametrize("value", [1, 0, "yes", 1.5])
def test_a_prefetch_flag_that_is_no_bool_is_refused_and_the_daemon_keeps_serving(
    plain_daemon: Daemon, value: Any
) -> None:
    daemon = plain_daemon
    key = os.urandom(KEY_BYTES)
    reply = raw_lookup(daemon, [key], prefetch=value)
    assert (reply["ok"], reply["code"], reply["name"], reply["id"]) == (False, 4, "BAD_REQUEST", 77)
    assert int(ErrorCode.BAD_REQUEST) == 4 and "prefetch" in reply["message"]
    assert raw_lookup(daemon, [key], prefetch=True)["hits"] == 0  # still serving
    with daemon.client() as c:
        assert c.put([key], [b"x" * 4096]) == [PutStatus.STORED]
        assert c.lookup([key], prefetch=True).tiers == ["memory"]  # in memory: nothing to prefetch
        assert prefetch_stats(c)["prefetches"] == 0 and prefetch_stats(c)["declined"] == 0


def test_lookup_with_prefetch_moves_redis_chunks_into_memory(
    daemon_factory: Callable[..., Daemon], redis_server: RedisServer
) -> None:
    daemon = daemon_factory(remote_url=redis_server.url)
    keys = [os.urandom(KEY_BYTES) for _ in range(3)]
    data = [os.urandom(MiB) for _ in keys]
    with daemon.client() as c:
        for k, d in zip(keys, data):
            assert c.put([k], [d]) == [PutStatus.STORED]
        wait_for(lambda: (r := c.stats()["tiers"]["redis"])["stores"] >= 3 and r["queued_writes"] == 0)
    assert daemon.stop() == 0
    daemon.start()  # memory starts empty; Redis keeps the chunks
    with daemon.client() as c:
        wait_for(lambda: c.stats()["tiers"]["redis"]["up"])
        assert c.lookup(keys, prefetch=True).tiers == ["redis"] * 3
        wait_for(lambda: c.lookup(keys).tiers == ["memory"] * 3)
        stats = settled(c, 3)
        assert (stats["prefetches"], stats["prefetched_bytes"], stats["declined"]) == (1, 3 * MiB, 0)
        assert c.stats()["tiers"]["redis"]["promotions"] == 3
        assert [bytes(g) for g in c.get(keys)] == data


# -- the prefetcher in-process: one prefetch per key, close ---------------------------------
NS = "ns"
A = owner_of(b"conn-1", [b"k" * 32])
"""An owner for the in-process tests that start prefetches and cancel none."""


async def _until(predicate: Callable[[], bool]) -> None:
    for _ in range(3000):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_a_second_prefetch_of_keys_being_prefetched_starts_nothing(
    runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    async def scenario() -> None:
        links = TierLinks(spill_ahead_bytes=0)  # a disk takes the spills
        memory = memory_tier(links=links)
        disk = SlowDisk(MiB)
        store = closed_at_end(TieredStore(memory, disk, links=links))  # type: ignore[arg-type]
        budget = ByteBudget(64 * MiB)
        prefetcher = closed_at_end(Prefetcher(store, budget))
        keys = [os.urandom(32) for _ in range(3)]
        prefetcher.start(NS, keys, ["disk"] * 3, A)
        prefetcher.start(NS, keys, ["disk"] * 3, A)
        prefetcher.start(NS, [keys[0], os.urandom(32)], ["disk", None], A)
        assert prefetcher.stats()["running"] == 1
        await asyncio.get_running_loop().run_in_executor(None, disk.started.wait, 30)
        assert budget.in_use == prefetcher.held_bytes == 3 * MiB  # the bytes being read
        prefetcher.start(NS, keys, ["disk"] * 3, A)
        assert prefetcher.stats()["running"] == 1
        disk.go.set()
        await _until(lambda: not prefetcher.stats()["running"])
        c = prefetcher.counters
        assert (c.prefetches, c.chunks, c.bytes, c.declined) == (1, 3, 3 * MiB, 0)
        assert budget.in_use == 0
        assert all(memory.peek(ChunkKey(NS, k)) for k in keys)
        # Memory holds them now: a new start promotes nothing.
        prefetcher.start(NS, keys, ["disk"] * 3, A)
        await _until(lambda: not prefetcher.stats()["running"])
        assert (c.prefetches, c.chunks) == (1, 3)

    runner.run(scenario())


def test_close_cancels_running_prefetches_and_gives_everything_back(
    runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    async def scenario() -> None:
        links = TierLinks(spill_ahead_bytes=0)  # a disk takes the spills
        memory = memory_tier(links=links)
        disk = SlowDisk(MiB)
        store = closed_at_end(TieredStore(memory, disk, links=links))  # type: ignore[arg-type]
        budget = ByteBudget(64 * MiB)
        prefetcher = Prefetcher(store, budget)
        prefetcher.start(NS, [os.urandom(32) for _ in range(2)], ["disk", "disk"], A)
        await asyncio.get_running_loop().run_in_executor(None, disk.started.wait, 30)
        await prefetcher.close()
        assert prefetcher.stats()["running"] == 0 and budget.in_use == 0 and prefetcher.held_bytes == 0
        prefetcher.start(NS, [os.urandom(32)], ["disk"], A)  # closed: starts nothing, declines nothing
        assert prefetcher.stats()["running"] == 0 and prefetcher.counters.declined == 0
        disk.go.set()
        # The reads' room goes back once their threads are done; nothing became visible.
        await _until(lambda: memory.allocator.allocated_bytes == 0)
        assert memory.chunks == 0 and prefetcher.counters.chunks == 0

    runner.run(scenario())


# -- cancelled with the request (cancel_prefetch) --------------------------------------------
@pytest.mark.parametrize(
    "fields", [{"cancel_prefetch": 1}, {"cancel_prefetch": "yes"}, {"prefetch": True, "cancel_prefetch": True}]
)
def test_a_bad_cancel_prefetch_is_refused_and_the_daemon_keeps_serving(
    plain_daemon: Daemon, fields: dict[str, Any]
) -> None:
    key = os.urandom(KEY_BYTES)
    reply = raw_lookup(plain_daemon, [key], **fields)
    assert (reply["ok"], reply["name"], reply["id"]) == (False, "BAD_REQUEST", 77)
    assert "cancel_prefetch" in reply["message"]
    with plain_daemon.client() as c:
        assert c.lookup([key], cancel_prefetch=True).hit_chunks == 0  # nothing running: nothing cancelled
        assert prefetch_stats(c)["cancelled"] == 0
        assert c.hello()["prefetch_cancel"] is True
    with pytest.raises(ValueError, match="not both"):
        calls_lookup("ns", [key], prefetch=True, cancel_prefetch=True)


def test_a_prefetch_is_cancelled_when_its_request_gives_it_up(
    daemon_factory: Callable[..., Daemon], redis_server: RedisServer
) -> None:
    """Redis behind a slow link (128 KiB/s towards the daemon): a prefetch of 2 chunks of
    256 KiB runs for seconds; the cancel stops it, gives its budget back, promotes
    nothing, and the daemon still serves the chunks right."""
    keys = [os.urandom(KEY_BYTES) for _ in range(2)]
    data = [os.urandom(256 * KiB) for _ in keys]
    daemon = daemon_factory(remote_url=redis_server.url)
    with daemon.client() as c:
        for k, d in zip(keys, data):
            assert c.put([k], [d]) == [PutStatus.STORED]
        wait_for(lambda: (r := c.stats()["tiers"]["redis"])["stores"] >= 2 and r["queued_writes"] == 0)
    assert daemon.stop() == 0
    link = SlowLink(redis_server.port, down_rate=128 * KiB)
    slow = daemon_factory(remote_url=f"redis://127.0.0.1:{link.port}", remote_timeout_s=60)
    try:
        with slow.client() as c:
            wait_for(lambda: c.stats()["tiers"]["redis"]["up"])
            assert c.lookup(keys, prefetch=True).tiers == ["redis"] * 2
            wait_for(lambda: prefetch_stats(c)["held_bytes"] > 0)  # reading through the link
            assert c.lookup(keys, cancel_prefetch=True).tiers == ["redis"] * 2
            stats = dict(wait_for(lambda: (s := prefetch_stats(c))["running"] == 0 and s))
            assert (stats["cancelled"], stats["held_bytes"], stats["prefetched_chunks"]) == (1, 0, 0)
            assert c.stats()["server"]["inflight_bytes"] == 0
            assert c.lookup(keys).tiers == ["redis"] * 2  # nothing was promoted
            assert sample(scrape(slow.metrics_port), "lmcache_prefetches_cancelled_total") == 1
            assert [bytes(g) for g in c.get(keys)] == data  # still served right, through the link
    finally:
        link.close()


def test_a_prefetch_shared_by_two_requests_runs_until_both_cancel(
    runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    async def scenario() -> None:
        links = TierLinks(spill_ahead_bytes=0)  # a disk takes the spills
        memory = memory_tier(links=links)
        disk = SlowDisk(MiB)
        store = closed_at_end(TieredStore(memory, disk, links=links))  # type: ignore[arg-type]
        budget = ByteBudget(64 * MiB)
        prefetcher = closed_at_end(Prefetcher(store, budget))
        keys = [os.urandom(32) for _ in range(3)]
        a, b = owner_of(b"conn-1", keys), owner_of(b"conn-1", keys[:2])
        prefetcher.start(NS, keys, ["disk"] * 3, a)  # request a
        prefetcher.start(NS, keys[:2], ["disk"] * 2, b)  # request b shares a's prefix: joins
        await asyncio.get_running_loop().run_in_executor(None, disk.started.wait, 30)
        assert prefetcher.cancel(NS, [os.urandom(32)], a) == 0  # nothing of it runs
        assert prefetcher.cancel(NS, keys, a) == 0  # a gives up; b still wants it
        assert prefetcher.stats()["running"] == 1 and budget.in_use == 3 * MiB
        assert prefetcher.cancel(NS, keys[:2], b) == 1  # b too: cancelled
        await _until(lambda: not prefetcher.stats()["running"])
        assert budget.in_use == prefetcher.held_bytes == 0 and prefetcher.counters.cancelled == 1
        assert prefetcher.cancel(NS, keys, a) == 0  # gone: a late cancel does nothing
        disk.go.set()
        await _until(lambda: memory.allocator.allocated_bytes == 0)
        assert memory.chunks == 0 and prefetcher.counters.chunks == 0
        # The keys are free again: a new lookup starts a new prefetch of them.
        prefetcher.start(NS, keys, ["disk"] * 3, a)
        await _until(lambda: not prefetcher.stats()["running"])
        assert prefetcher.counters.chunks == 3 and prefetcher.counters.prefetches == 2

    runner.run(scenario())


def test_a_cancel_takes_back_only_its_own_requests_join(runner: asyncio.Runner, closed_at_end: Closer) -> None:
    """Issue 39 item 9: a cancel once took one owner from every prefetch holding its
    keys, whoever sent it; now it takes back only the join of the same connection's
    lookup of the same keys, and a lookup repeated by a parked request joins once."""

    async def scenario() -> None:
        links = TierLinks(spill_ahead_bytes=0)  # a disk takes the spills
        memory = memory_tier(links=links)
        disk = SlowDisk(MiB)
        store = closed_at_end(TieredStore(memory, disk, links=links))  # type: ignore[arg-type]
        budget = ByteBudget(64 * MiB)
        prefetcher = closed_at_end(Prefetcher(store, budget))
        keys = [os.urandom(32) for _ in range(2)]
        mine, other_reader = owner_of(b"conn-1", keys), owner_of(b"conn-2", keys)
        prefetcher.start(NS, keys, ["disk"] * 2, mine)
        prefetcher.start(NS, keys, ["disk"] * 2, mine)  # the parked request looks up again
        await asyncio.get_running_loop().run_in_executor(None, disk.started.wait, 30)
        assert prefetcher.cancel(NS, keys, other_reader) == 0  # not its join
        assert prefetcher.cancel(NS, keys, other_reader) == 0  # nor the next time
        assert prefetcher.stats()["running"] == 1
        assert prefetcher.cancel(NS, keys, mine) == 1  # its own request: one cancel is enough
        await _until(lambda: not prefetcher.stats()["running"])
        assert prefetcher.counters.cancelled == 1
        disk.go.set()
        await _until(lambda: memory.allocator.allocated_bytes == 0)

    runner.run(scenario())


def test_another_reader_cannot_cancel_a_prefetch_it_did_not_join(
    daemon_factory: Callable[..., Daemon], redis_server: RedisServer
) -> None:
    """Through the daemon (issue 39 item 9): two connections read the same namespace;
    the second's ``cancel_prefetch`` of the first's keys leaves the first's prefetch
    running; the first's own cancel stops it, once, however often it looked up."""
    keys = [os.urandom(KEY_BYTES) for _ in range(2)]
    data = [os.urandom(256 * KiB) for _ in keys]
    daemon = daemon_factory(remote_url=redis_server.url)
    with daemon.client() as c:
        for k, d in zip(keys, data):
            assert c.put([k], [d]) == [PutStatus.STORED]
        wait_for(lambda: (r := c.stats()["tiers"]["redis"])["stores"] >= 2 and r["queued_writes"] == 0)
    assert daemon.stop() == 0
    link = SlowLink(redis_server.port, down_rate=64 * KiB)  # ~8 s for the two chunks
    slow = daemon_factory(remote_url=f"redis://127.0.0.1:{link.port}", remote_timeout_s=60)
    try:
        with slow.client() as owner, slow.client() as other:
            wait_for(lambda: owner.stats()["tiers"]["redis"]["up"])
            assert owner.lookup(keys, prefetch=True).tiers == ["redis"] * 2
            wait_for(lambda: prefetch_stats(owner)["held_bytes"] > 0)  # reading through the link
            assert owner.lookup(keys, prefetch=True).hit_chunks == 2  # looked up again: joins once
            for _ in range(3):
                assert other.lookup(keys, cancel_prefetch=True).hit_chunks == 2
            stats = prefetch_stats(owner)
            assert (stats["cancelled"], stats["running"]) == (0, 1)  # still running for its owner
            assert owner.lookup(keys, cancel_prefetch=True).hit_chunks == 2
            stats = dict(wait_for(lambda: (s := prefetch_stats(owner))["running"] == 0 and s))
            assert (stats["cancelled"], stats["held_bytes"], stats["prefetched_chunks"]) == (1, 0, 0)
            assert [bytes(g) for g in other.get(keys)] == data
    finally:
        link.close()
