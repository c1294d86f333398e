"""Admission to the disk and Redis tiers (issue #27 items 1 and 6).

In-process, on a real pool, a real DiskTier in ``tmp_path`` and a real
redis-server (conftest): what each mode writes to disk and to Redis and what it
does not, that a declined chunk is served from memory while memory holds it,
that ``always`` writes what the store without admission writes; the sketch's
bound and aging; the rule against a full tier's victim; bad settings refused.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest
import redis

from lmcache_client.protocol import PutStatus
from lmcache_server.config import ConfigError, load_config
from lmcache_server.storage import ChunkKey, MemoryPool, MemoryTier, TieredStore, TierLinks
from lmcache_server.storage.disk import DiskTier
from lmcache_server.storage.policy import LRUPolicy
from lmcache_server.storage.policy.history import key_hash
from lmcache_server.storage.policy.sketch import MAX_COUNT, FrequencySketch
from lmcache_server.storage.remote import RemoteTier
from lmcache_server.storage.tiered.gate import (
    MODES,
    Accesses,
    ClearEpochs,
    SentKeys,
    StoreGate,
    TierGate,
)

from ..conftest import Closer, RedisServer

NS = "ns"
MiB = 1 << 20
POOL_CHUNKS = 8  # an 8 MiB pool of 1 MiB chunks


async def tiers(tmp_path: Path, url: str, admission: StoreGate | None) -> TieredStore:
    links = TierLinks(spill_ahead_bytes=0)  # a disk takes the spills
    memory = MemoryTier(MemoryPool(POOL_CHUNKS * MiB, "off"), max_pinned_bytes=0, policy=LRUPolicy(), links=links)
    disk = DiskTier(tmp_path / "spill", 64 * MiB, policy=LRUPolicy(), links=links)
    await disk.open()
    remote = RemoteTier.redis(url, links=links)
    await remote.open()
    return TieredStore(memory, disk, remote, gate=admission, links=links)


def chunks(n: int) -> tuple[list[bytes], list[bytes]]:
    return [os.urandom(32) for _ in range(n)], [os.urandom(MiB) for _ in range(n)]


async def put(store: TieredStore, digests: list[bytes], data: list[bytes]) -> None:
    for d, payload in zip(digests, data):  # one at a time: evictions in a known order
        assert await store.put_many(NS, [d], [payload]) == [PutStatus.STORED]


async def read(store: TieredStore, digests: list[bytes]) -> list[bytes | None]:
    got = await store.get_many(NS, digests)
    out = [None if c is None else bytes(c.data) for c in got]
    for c in got:
        if c is not None:
            c.release()
    return out


async def written(store: TieredStore, digests: list[bytes]) -> tuple[set[bytes], set[bytes]]:
    """The digests on disk and in Redis, once both write-behind queues are drained."""
    assert await store.flush(10.0)
    assert store.disk is not None and store.remote is not None
    r = redis.Redis(port=int(store.remote.url.rsplit(":", 1)[1]))
    try:
        in_redis = {d for d in digests if r.exists(store.remote.remote_key(ChunkKey(NS, d)))}
    finally:
        r.close()
    on_disk = {d for d in digests if store.disk.peek(ChunkKey(NS, d))}
    return on_disk, in_redis


@pytest.mark.parametrize("admission", [None, "always"])
def test_always_writes_every_evicted_chunk_to_disk_and_every_chunk_to_redis(
    tmp_path: Path, redis_server: RedisServer, admission: str | None, runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    async def scenario() -> None:
        gate = None if admission is None else StoreGate(admission, admission)
        store = closed_at_end(await tiers(tmp_path, redis_server.url, gate))
        digests, data = chunks(12)
        await put(store, digests, data)
        on_disk, in_redis = await written(store, digests)
        assert on_disk == set(digests[:4])  # the four evicted (LRU), nothing else
        assert in_redis == set(digests)
        assert await read(store, digests) == data
        if gate is not None:
            stats = store.stats()["tiers"]
            assert stats["disk"]["admitted"] == 4 and stats["disk"]["declined"] == 0
            assert stats["redis"]["admitted"] == 12 and stats["redis"]["declined"] == 0

    runner.run(scenario())


def test_reused_writes_only_chunks_read_or_put_again(
    tmp_path: Path, redis_server: RedisServer, runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    async def scenario() -> None:
        store = closed_at_end(await tiers(tmp_path, redis_server.url, StoreGate("reused", "reused")))
        digests, data = chunks(16)
        first, second = digests[:8], digests[8:]
        await put(store, first, data[:8])  # the pool is full, nothing evicted yet
        # Nothing was reused: nothing goes to Redis, and every chunk is served from memory.
        assert (await written(store, first))[1] == set()
        assert await read(store, first[:1]) == data[:1]  # read once: reused
        assert await store.put_many(NS, [first[1]], [data[1]]) == [PutStatus.EXISTS]  # put again: reused
        assert store.memory.peek(ChunkKey(NS, first[2]))
        await put(store, second, data[8:])  # evicts all of the first eight
        on_disk, in_redis = await written(store, digests)
        assert on_disk == {first[0], first[1]}
        assert in_redis == {first[0], first[1]}  # queued when reused, not when stored
        stats = store.stats()["tiers"]
        assert (stats["disk"]["admitted"], stats["disk"]["declined"]) == (2, 6)
        assert stats["disk"]["declined_bytes"] == 6 * MiB
        assert (stats["redis"]["admitted"], stats["redis"]["declined"]) == (2, 6)
        # The admitted ones are served back from disk with their bytes; the others are gone.
        assert await read(store, first[:3]) == [data[0], data[1], None]

    runner.run(scenario())


def test_a_chunk_dropped_unreused_and_put_again_counts_as_reused(
    tmp_path: Path, redis_server: RedisServer, runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    async def scenario() -> None:
        store = closed_at_end(await tiers(tmp_path, redis_server.url, StoreGate("reused", "reused")))
        digests, data = chunks(9)
        await put(store, digests, data)  # digests[0] is evicted, unread: dropped
        assert await read(store, digests[:1]) == [None]
        await put(store, digests[:1], data[:1])  # put again (a second replica): reused
        in_redis = (await written(store, digests))[1]
        assert in_redis == {digests[0]}  # written at its second store

    runner.run(scenario())


def test_frequency_admits_chunks_used_twice(
    tmp_path: Path, redis_server: RedisServer, runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    async def scenario() -> None:
        store = closed_at_end(await tiers(tmp_path, redis_server.url, StoreGate("frequency", "frequency")))
        digests, data = chunks(16)
        await put(store, digests[:8], data[:8])
        assert await read(store, digests[:2]) == data[:2]  # two accesses each: a put and a get
        await put(store, digests[8:], data[8:])
        on_disk, in_redis = await written(store, digests)
        assert on_disk == set(digests[:2]) and in_redis == set(digests[:2])
        assert store.stats()["tiers"]["disk"]["sketch_bytes"] == store.gate.accesses.sketch.nbytes  # type: ignore[union-attr]

    runner.run(scenario())


def test_frequency_against_a_full_disk_compares_with_its_victim(
    tmp_path: Path, redis_server: RedisServer, runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    async def scenario() -> None:
        store = closed_at_end(await tiers(tmp_path, redis_server.url, StoreGate("frequency", "always")))
        assert store.disk is not None
        store.disk.index.max_bytes = 2 * (MiB + 4096)  # room for two chunk files
        digests, data = chunks(12)
        hot, warm, cold = digests[:2], digests[2:3], digests[3:4]
        await put(store, digests[:4], data[:4])
        for _ in range(3):
            await read(store, hot)  # hot: 4 accesses
        await read(store, warm)  # warm and cold: 2 accesses each
        await read(store, cold)
        await put(store, digests[4:], data[4:])  # evicts the first four in order
        on_disk, _ = await written(store, digests)
        assert on_disk == set(hot)  # warm and cold do not beat a hot victim
        assert store.stats()["tiers"]["disk"]["declined"] >= 2

    runner.run(scenario())


def test_sketch_memory_is_bounded_and_ages() -> None:
    sketch = FrequencySketch(width=1024, sample_factor=10)
    size = sketch.nbytes
    assert size == 4 * 1024
    for i in range(50_000):  # far more keys than counters
        sketch.increment(key_hash(ChunkKey(NS, i.to_bytes(32, "big"))))
    assert sketch.nbytes == size and sketch.agings >= 4
    fresh = FrequencySketch(width=1 << 12, sample_factor=10)
    h = key_hash(ChunkKey(NS, b"k" * 32))
    for _ in range(6):
        fresh.increment(h)
    assert fresh.estimate(h) == 6
    for _ in range(40):
        fresh.increment(h)
    assert fresh.estimate(h) == MAX_COUNT  # saturates
    before = fresh.agings
    for i in range(fresh.sample_size):  # other keys, until the next aging
        fresh.increment(key_hash(ChunkKey(NS, i.to_bytes(32, "little"))))
        if fresh.agings > before:
            break
    assert fresh.agings == before + 1 and fresh.estimate(h) <= MAX_COUNT // 2 + 1


def test_rule_needs_two_accesses_and_to_beat_the_victim() -> None:
    accesses = Accesses(FrequencySketch(1 << 10), track_reuse=False)
    rule = TierGate("disk", "frequency", accesses)
    a, b = ChunkKey(NS, b"a" * 32), ChunkKey(NS, b"b" * 32)
    accesses.stored(a)
    assert not rule.passes(a)  # one access
    accesses.accessed(a)
    assert rule.passes(a) and rule.passes(a, lambda: None)  # two, and the tier has room
    for _ in range(3):
        accesses.accessed(b)
    assert not rule.passes(a, lambda: b)  # 2 against 3
    assert rule.passes(b, lambda: a)
    with pytest.raises(ValueError, match="always, reused, frequency"):
        TierGate("disk", "sometimes", accesses)


@pytest.mark.parametrize("key", ["disk_admission", "remote_admission"])
def test_bad_admission_values_are_refused_with_the_choices(key: str) -> None:
    assert load_config(None, {}).__getattribute__(key) == "always"
    for mode in MODES:
        assert getattr(load_config(None, {}, {key: mode.upper()}), key) == mode
    with pytest.raises(ConfigError) as info:
        load_config(None, {}, {key: "lfu"})
    assert info.value.key == key
    assert f"'{key}'" in str(info.value) and "always, reused or frequency" in str(info.value)


def test_a_read_of_a_chunk_memory_does_not_hold_is_remembered_not_kept() -> None:
    """A lower-tier hit memory had no room for is no resident chunk: the reused set
    (which memory's removals keep bounded) does not take it; the history of keys
    does, so a later store of it counts as a reuse."""
    accesses = Accesses(None, track_reuse=True)
    key = ChunkKey(NS, b"r" * 32)
    accesses.accessed(key, resident=False)
    assert not accesses.reused(key) and not accesses._reused
    accesses.stored(key)
    assert accesses.reused(key)
    accesses.left_memory(key)
    assert not accesses._reused


def test_replay_model_keeps_the_oracle_hit_rate_and_admission_writes_less() -> None:
    """benchmarks/replay_admission.py on a synthetic trace: the rows it reports
    hold together (the oracle admits every chunk read again, so it hits exactly as
    ``always``; the online modes write less than ``always``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from policy_sim import distinct_blocks, synthetic_requests
    from replay_admission import run

    requests = synthetic_requests(1500)
    cap = distinct_blocks(requests) // 20
    rows = {r["mode"]: r for r in run(requests, [cap], "lru", 10, MiB, processes=1, progress=lambda s: None)}
    assert set(rows) == {"always", "reused", "frequency", "always/reused", "oracle"}
    assert rows["oracle"]["hit_tokens"] == rows["always"]["hit_tokens"]
    assert rows["always"]["written_per_hit_token_reduction_vs_always"] == 1.0
    for mode in ("reused", "frequency", "oracle"):
        assert rows[mode]["disk_bytes_written"] < rows["always"]["disk_bytes_written"]
        assert rows[mode]["redis_bytes_written"] < rows["always"]["redis_bytes_written"]
    assert rows["always/reused"]["redis_bytes_written"] < rows["always"]["redis_bytes_written"]


@pytest.mark.parametrize("mode", ["always", "reused"])
def test_a_declined_chunk_is_not_spilled_ahead_and_stays_served_from_memory(
    tmp_path: Path, redis_server: RedisServer, mode: str, runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    """Spill-ahead lends the coldest chunks to the disk before room is needed; one the
    disk's admission declines stays in memory (and is served from there) until a put
    needs its room."""

    async def scenario() -> None:
        links = TierLinks(spill_ahead_bytes=MiB)
        memory = MemoryTier(MemoryPool(POOL_CHUNKS * MiB, "off"), max_pinned_bytes=0, policy=LRUPolicy(), links=links)
        disk = DiskTier(tmp_path / "spill", 64 * MiB, policy=LRUPolicy(), links=links)
        await disk.open()
        store = closed_at_end(TieredStore(memory, disk, gate=StoreGate(mode, None), links=links))
        digests, data = chunks(POOL_CHUNKS)
        await put(store, digests, data)  # the last allocation leaves no room: spill ahead
        assert await store.flush(10.0)
        if mode == "always":
            assert memory.chunks == POOL_CHUNKS - 1 and disk.peek(ChunkKey(NS, digests[0]))
        else:
            assert memory.chunks == POOL_CHUNKS and not disk.peek(ChunkKey(NS, digests[0]))
            hits = memory.counters.hits
            assert await read(store, digests) == data  # every one from memory
            assert memory.counters.hits == hits + POOL_CHUNKS
            assert store.stats()["tiers"]["disk"]["declined"] == 0  # not dropped: still here

    runner.run(scenario())


def test_a_chunk_deleted_then_stored_and_reused_again_goes_to_redis_again(
    tmp_path: Path, redis_server: RedisServer, runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    async def scenario() -> None:
        store = closed_at_end(await tiers(tmp_path, redis_server.url, StoreGate("reused", "reused")))
        digests, data = chunks(2)
        for clear in (False, True):
            await put(store, digests, data)
            assert await read(store, digests) == data  # reused: queued for Redis
            assert (await written(store, digests))[1] == set(digests)
            if clear:
                assert await store.clear(NS) == 2
            else:
                assert await store.delete(NS, digests) == [True, True]
            assert (await written(store, digests))[1] == set()
        await put(store, digests, data)
        assert await read(store, digests[:1]) == data[:1]
        # Sent again after the clear, once read; a put after a clear is a first put.
        assert (await written(store, digests))[1] == {digests[0]}

    runner.run(scenario())


def test_sent_keys_forget_a_key_once_redis_ttl_has_dropped_it() -> None:
    now = [1000.0]
    sent = SentKeys(ttl_s=60.0, clock=lambda: now[0])
    key, other = ChunkKey(NS, b"a" * 32), ChunkKey(NS, b"b" * 32)
    sent.add(key)
    assert key in sent and other not in sent
    now[0] += 59.0  # within the TTL (a little under: 1023 of 1024 units)
    assert key in sent
    now[0] += 1.0  # Redis has dropped it: forgotten, so it may be written again
    assert key not in sent
    sent.add(key)
    assert key in sent
    sent.discard(key)
    assert key not in sent
    forever = SentKeys()  # no TTL: remembered however old
    forever.add(key)
    now[0] += 10**9
    assert key in forever


def test_with_a_redis_ttl_a_reused_chunk_goes_to_redis_again_after_it_expired(
    tmp_path: Path, redis_server: RedisServer, runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    async def scenario() -> None:
        links = TierLinks()
        memory = MemoryTier(MemoryPool(POOL_CHUNKS * MiB, "off"), max_pinned_bytes=0, policy=LRUPolicy(), links=links)
        remote = RemoteTier.redis(redis_server.url, ttl_s=1.0, links=links)
        await remote.open()
        gate = StoreGate("always", "reused", remote_ttl_s=1.0)
        store = closed_at_end(TieredStore(memory, None, remote, gate=gate, links=links))
        digests, data = chunks(1)
        r = redis.Redis(port=int(redis_server.url.rsplit(":", 1)[1]))
        key = remote.remote_key(ChunkKey(NS, digests[0]))
        try:
            await put(store, digests, data)
            assert await read(store, digests) == data  # reused: queued for Redis
            assert await store.flush(10.0) and r.exists(key)
            deadline = time.monotonic() + 10
            while r.exists(key):  # Redis drops it after its TTL
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert await read(store, digests) == data  # memory still holds it: read again
            assert await store.flush(10.0) and r.exists(key), "written to Redis again"
            assert store.stats()["tiers"]["redis"]["admitted"] == 2
        finally:
            r.close()

    runner.run(scenario())


def test_a_clear_of_one_namespace_forgets_only_its_keys(
    tmp_path: Path, redis_server: RedisServer, runner: asyncio.Runner, closed_at_end: Closer
) -> None:
    """Issue 39 item 9: a ``clear`` of one namespace reset the admission state of every
    namespace (the keys sent to Redis, the keys remembered after leaving memory), so
    another namespace's chunks were written to Redis a second time.  Now only the
    cleared namespace's keys are forgotten."""

    async def scenario() -> None:
        store = closed_at_end(await tiers(tmp_path, redis_server.url, StoreGate("reused", "reused")))
        other = "other"
        kept, kept_data = chunks(2)
        gone, gone_data = chunks(1)
        for d, payload in zip(kept, kept_data):
            assert await store.put_many(other, [d], [payload]) == [PutStatus.STORED]
        await put(store, gone, gone_data)
        for ns, digests in ((other, kept), (NS, gone)):  # reused: each queued for Redis once
            got = await store.get_many(ns, digests)
            for c in got:
                assert c is not None
                c.release()
        assert await store.flush(10.0)
        assert store.stats()["tiers"]["redis"]["admitted"] == 3
        assert await store.clear(NS) == 1
        for _ in range(2):  # reads of the other namespace's chunks, still in memory: sent already
            got = await store.get_many(other, kept)
            assert [bytes(c.data) for c in got if c is not None] == kept_data
            for c in got:
                if c is not None:
                    c.release()
        assert await store.flush(10.0)
        assert store.stats()["tiers"]["redis"]["admitted"] == 3, "the other namespace's chunks were sent again"
        # The cleared namespace's keys are forgotten: put again, a first put; read, sent again.
        await put(store, gone, gone_data)
        assert await read(store, gone) == gone_data
        assert (await written(store, gone))[1] == set(gone)
        assert store.stats()["tiers"]["redis"]["admitted"] == 4

    runner.run(scenario())


def test_clear_epochs_keep_namespaces_apart_within_their_bound() -> None:
    a, b = ChunkKey("a", b"k" * 32), ChunkKey("b", b"k" * 32)
    sent = SentKeys(epochs=(epochs := ClearEpochs(limit=2)))
    sent.add(a)
    sent.add(b)
    assert epochs.cleared("a")
    assert a not in sent and b in sent  # a's clear forgets a's keys only
    sent.add(a)
    assert a in sent
    assert epochs.cleared("b") and b not in sent and a in sent
    assert not epochs.cleared("c")  # a third namespace: past the bound, the caller forgets all
    assert not epochs.cleared(None)  # a clear of every namespace, too
