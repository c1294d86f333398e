"""Redis-only residency announced as locality REMOTE (docs/events.md, "Media and
locality"), against the real daemon, a real redis-server and real ZeroMQ sockets:

- a chunk evicted from memory (no disk tier) while Redis holds it: ``BlockStored``
  ``CPU``/``REMOTE`` then ``BlockRemoved`` ``CPU``/``LOCAL`` (vLLM's decoder reads
  the stream); a snapshot taken meanwhile carries locality ``REMOTE`` and snapshot +
  suffix equals the whole stream; a get promotes it back: ``BlockStored``
  ``CPU``/``LOCAL`` then ``BlockRemoved`` ``CPU``/``REMOTE``;
- the REMOTE announcement is withdrawn (``BlockRemoved`` ``CPU``/``REMOTE``) when the
  key is deleted in Redis behind the daemon's back (found by the audit), deleted
  through the daemon, expires (``remote_ttl_s``), or Redis goes away; a put of the
  chunk again makes it ``LOCAL`` again;
- past ``events_remote_max_chunks`` the oldest key is forgotten: its chunk is removed;
- with ``events_encoding: array`` (no locality field) or ``events_remote: false``:
  a removal, as without Redis;
- bad config values are refused with the key, the value and what was expected;
- the memory of what Redis holds on its own (a real RemoteTier and redis-server): the
  audit asks only about chunks announced REMOTE, at most ``AUDIT_BATCH`` keys a round
  trip, and withdraws each gone one once; TTLs and the bound forget, oldest first.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

from lmcache_client import CacheClient
from lmcache_client.keys import ROOT_KEY, chunk_keys, chunk_tokens
from lmcache_client.protocol import PutStatus
from lmcache_server.config import ConfigError, load_config
from lmcache_server.events.remote import AUDIT_BATCH, REMOTE, RemoteHeld
from lmcache_server.storage.base import ChunkKey
from lmcache_server.storage.remote import RemoteTier

from ..conftest import Daemon, MooncakeMaster, RedisServer, free_port, wait_for
from ..integrations.vllm.vllm_harness.fixtures import vllm_python  # noqa: F401 - a fixture
from ..server.events_router import RouterIndex, snapshot
from .test_events import (
    BLOCK,
    CHUNK,
    MODEL,
    NS,
    all_batches,
    chunk,
    decode,
    decode_with_vllm,
    events_daemon,
    events_of,
    expected_hashes,
    prompt,
    quiet,
    replay,
)

TOPIC = f"kv@node-a@{MODEL}"
MiB = 1 << 20


class PlacedIndex(RouterIndex):
    """A router index that keeps ``medium`` and ``locality`` apart: blocks live under
    ``"CPU/LOCAL"``, ``"CPU/REMOTE"``, ``"STORAGE/LOCAL"``."""

    def event(self, topic: str, e: dict[str, Any]) -> None:
        if "medium" in e:
            e = {**e, "medium": f"{e['medium']}/{e.get('locality', 'LOCAL')}"}
        super().event(topic, e)


def remote_daemon(factory: Callable[..., Daemon], redis_server: RedisServer, **config: Any) -> Daemon:
    """Events on, a 4 MiB pool without a disk (1 MiB chunks evict at once), Redis, a
    snapshot endpoint; the audit off unless asked."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    settings: dict[str, Any] = {
        "remote_url": redis_server.url,
        "max_local_cpu_size": "4MiB",
        "events_snapshot_endpoint": endpoint,
        "events_remote_audit_s": 0,
        **config,
    }
    daemon = events_daemon(factory, **settings)
    daemon.snapshot = endpoint  # type: ignore[attr-defined]
    return daemon


@pytest.fixture
def r(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A redis-py client of the test's redis-server (to look behind the daemon's back)."""
    client = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    yield client
    client.close()


def redis_key(digest: bytes) -> bytes:
    """The daemon's Redis key of a chunk of ``NS`` (docs/storage.md)."""
    return f"lmcache:{hashlib.sha256(NS.encode()).hexdigest()[:16]}:{digest.hex()}".encode()


def acknowledged(c: CacheClient, r: redis.Redis, keys: list[bytes]) -> None:
    """Wait until Redis acknowledged the writes of ``keys``: Redis has them and the
    daemon's write queue is empty (a write leaves it when its acknowledgement is read,
    in the same step that tells the daemon's memory of what Redis holds)."""
    wait_for(lambda: all(r.exists(redis_key(k)) for k in keys) and c.stats()["tiers"]["redis"]["queued_writes"] == 0)


def put_then_evict(c: CacheClient, r: redis.Redis, tokens: list[int], wait: bool = True) -> list[bytes]:
    """Put ``tokens``' chunks (1 MiB each) with their token ids; once Redis acknowledged
    them (``wait``), push them out of memory with token-less puts (never announced)."""
    keys, toks = chunk_keys(tokens, CHUNK), chunk_tokens(tokens, CHUNK)
    assert c.put(keys, [os.urandom(MiB) for _ in keys], tokens=toks) == [PutStatus.STORED] * len(keys)
    if wait:
        acknowledged(c, r, keys)
    for _ in range(6):
        assert c.put([os.urandom(32)], [os.urandom(MiB)]) == [PutStatus.STORED]
    wait_for(lambda: c.lookup(keys).tiers == ["redis"] * len(keys))
    return keys


def placed(events: list[dict[str, Any]]) -> list[tuple[str, Any, Any, Any]]:
    return [(e["type"], e.get("block_hashes"), e.get("medium"), e.get("locality")) for e in events]


def test_an_evicted_chunk_redis_holds_moves_to_remote_and_a_get_brings_it_back(
    daemon_factory: Callable[..., Daemon],
    redis_server: RedisServer,
    r: redis.Redis,
    vllm_python: Path,  # noqa: F811
) -> None:
    daemon = remote_daemon(daemon_factory, redis_server)
    tokens = prompt(31, 2)
    with daemon.client(namespace=NS) as c:
        keys = put_then_evict(c, r, tokens)
        stats = quiet(c, remote_moved_chunks=2)
        assert stats["announced_chunks_now"] == 2 and stats["removed_chunks"] == 0
        # A router that starts now: the chunks only Redis holds, with locality REMOTE.
        meta, frames = snapshot(daemon.snapshot)  # type: ignore[attr-defined]
        joined = PlacedIndex(BLOCK).apply(frames)
        assert list(joined.state()) == [(TOPIC, "CPU/REMOTE")]
        assert meta["chunks"] == 2
        for key in keys:  # one at a time: the promotions' order is the events' order
            [data] = c.get([key])
            assert data is not None and len(data) == MiB
        quiet(c, moved_chunks=4)
        assert c.lookup(keys).tiers == ["memory", "memory"]
        stream = all_batches(daemon, c)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10).read()
    a, b = (expected_hashes(keys[i], [ROOT_KEY, *keys][i], chunk(tokens, i)) for i in range(2))
    events = events_of(decode_with_vllm(vllm_python, stream))
    assert placed(events) == [
        ("BlockStored", a, "CPU", "LOCAL"),
        ("BlockStored", b, "CPU", "LOCAL"),
        # evicted while Redis holds them: stored REMOTE first, then removed LOCAL
        ("BlockStored", a, "CPU", "REMOTE"),
        ("BlockRemoved", a, "CPU", "LOCAL"),
        ("BlockStored", b, "CPU", "REMOTE"),
        ("BlockRemoved", b, "CPU", "LOCAL"),
        # promoted back by the gets
        ("BlockStored", a, "CPU", "LOCAL"),
        ("BlockRemoved", a, "CPU", "REMOTE"),
        ("BlockStored", b, "CPU", "LOCAL"),
        ("BlockRemoved", b, "CPU", "REMOTE"),
    ]
    assert events[2]["parent_block_hash"] is None and events[4]["parent_block_hash"] == a[-1]
    assert events[2]["token_ids"] == chunk(tokens, 0)
    # Snapshot + the live suffix equals the whole stream, REMOTE blocks included.
    whole = PlacedIndex(BLOCK).apply(stream)
    assert joined.apply(replay(daemon, meta["seq"] + 1)).state() == whole.state()
    assert list(whole.state()) == [(TOPIC, "CPU/LOCAL")]
    assert b"lmcache_event_chunks_remote_total 2.0" in metrics
    assert b"lmcache_event_remote_known_chunks " in metrics


def test_the_audit_finds_a_key_deleted_in_redis_and_a_delete_withdraws_remote(
    daemon_factory: Callable[..., Daemon], redis_server: RedisServer, r: redis.Redis
) -> None:
    daemon = remote_daemon(daemon_factory, redis_server, events_remote_audit_s=0.2)
    first, second = prompt(32, 1), prompt(33, 1)
    with daemon.client(namespace=NS) as c:
        [ka] = put_then_evict(c, r, first)
        [kb] = put_then_evict(c, r, second)
        quiet(c, remote_moved_chunks=2)
        # Gone from Redis behind the daemon's back (maxmemory, another node's delete, ...).
        assert r.delete(redis_key(ka)) == 1
        stats = quiet(c, remote_removed_chunks=1, remote_audits=1)
        assert stats["announced_chunks_now"] == 1 and stats["remote_missed"] >= 1
        # A delete through the daemon: Redis is told first, the REMOTE blocks go.
        assert c.delete([kb]) == [True]
        stats = quiet(c, remote_removed_chunks=2)
        assert stats["announced_chunks_now"] == 0
        events = events_of(decode(all_batches(daemon, c)))
    ha, hb = expected_hashes(ka, ROOT_KEY, first), expected_hashes(kb, ROOT_KEY, second)
    assert placed(events) == [
        ("BlockStored", ha, "CPU", "LOCAL"),
        ("BlockStored", ha, "CPU", "REMOTE"),
        ("BlockRemoved", ha, "CPU", "LOCAL"),
        ("BlockStored", hb, "CPU", "LOCAL"),
        ("BlockStored", hb, "CPU", "REMOTE"),
        ("BlockRemoved", hb, "CPU", "LOCAL"),
        ("BlockRemoved", ha, "CPU", "REMOTE"),  # the audit
        ("BlockRemoved", hb, "CPU", "REMOTE"),  # the delete
    ]


def test_a_key_past_its_ttl_is_withdrawn(
    daemon_factory: Callable[..., Daemon], redis_server: RedisServer, r: redis.Redis
) -> None:
    daemon = remote_daemon(daemon_factory, redis_server, remote_ttl_s=4)
    tokens = prompt(34, 1)
    with daemon.client(namespace=NS) as c:
        [key] = put_then_evict(c, r, tokens)
        quiet(c, remote_moved_chunks=1)
        # No audit and no read: only the TTL (counted from the write, less a margin) ends it.
        stats = quiet(c, remote_removed_chunks=1)
        assert stats["remote_expired"] >= 1 and stats["remote_audits"] == 0
        events = events_of(decode(all_batches(daemon, c)))
    h = expected_hashes(key, ROOT_KEY, tokens)
    assert placed(events)[-2:] == [("BlockRemoved", h, "CPU", "LOCAL"), ("BlockRemoved", h, "CPU", "REMOTE")]


def test_redis_going_away_withdraws_remote(
    daemon_factory: Callable[..., Daemon], redis_server: RedisServer, r: redis.Redis
) -> None:
    daemon = remote_daemon(daemon_factory, redis_server, events_remote_audit_s=0.2)
    tokens = prompt(35, 1)
    with daemon.client(namespace=NS) as c:
        [key] = put_then_evict(c, r, tokens)
        quiet(c, remote_moved_chunks=1)
        redis_server.stop()
        # The audit's round trip fails: the uplink is down, nothing in Redis can be served.
        stats = quiet(c, remote_removed_chunks=1)
        assert stats["remote_down_forgets"] >= 1 and stats["remote_known_chunks"] == 0
        assert c.stats()["tiers"]["redis"]["up"] is False
        assert c.get([key]) == [None]
        events = events_of(decode(all_batches(daemon, c)))
    h = expected_hashes(key, ROOT_KEY, tokens)
    assert placed(events) == [
        ("BlockStored", h, "CPU", "LOCAL"),
        ("BlockStored", h, "CPU", "REMOTE"),
        ("BlockRemoved", h, "CPU", "LOCAL"),
        ("BlockRemoved", h, "CPU", "REMOTE"),
    ]


def test_a_chunk_put_again_while_only_redis_holds_it_is_local_again(
    daemon_factory: Callable[..., Daemon], redis_server: RedisServer, r: redis.Redis
) -> None:
    daemon = remote_daemon(daemon_factory, redis_server)
    tokens = prompt(39, 1)
    with daemon.client(namespace=NS) as c:
        [key] = put_then_evict(c, r, tokens)
        quiet(c, remote_moved_chunks=1)
        assert c.put([key], [os.urandom(MiB)], tokens=chunk_tokens(tokens, CHUNK)) == [PutStatus.STORED]
        stats = quiet(c, moved_chunks=2)
        assert stats["announced_chunks"] == 1  # announced once, moved twice
        events = events_of(decode(all_batches(daemon, c)))
    h = expected_hashes(key, ROOT_KEY, tokens)
    assert placed(events)[-2:] == [("BlockStored", h, "CPU", "LOCAL"), ("BlockRemoved", h, "CPU", "REMOTE")]


def test_past_max_chunks_the_oldest_key_is_forgotten(
    daemon_factory: Callable[..., Daemon], redis_server: RedisServer, r: redis.Redis
) -> None:
    daemon = remote_daemon(daemon_factory, redis_server, events_remote_max_chunks=1)
    first, second = prompt(36, 1), prompt(37, 1)
    with daemon.client(namespace=NS) as c:
        [ka] = chunk_keys(first, CHUNK)
        assert c.put([ka], [os.urandom(MiB)], tokens=chunk_tokens(first, CHUNK)) == [PutStatus.STORED]
        acknowledged(c, r, [ka])
        assert c.stats()["events"]["remote_known_chunks"] == 1
        # The second acknowledged write pushes the first key out of the bounded memory.
        [kb] = chunk_keys(second, CHUNK)
        assert c.put([kb], [os.urandom(MiB)], tokens=chunk_tokens(second, CHUNK)) == [PutStatus.STORED]
        acknowledged(c, r, [kb])
        assert c.stats()["events"]["remote_evicted"] == 1
        for _ in range(6):
            assert c.put([os.urandom(32)], [os.urandom(MiB)]) == [PutStatus.STORED]
        wait_for(lambda: c.lookup([ka]).tiers == ["redis"])  # Redis still holds it ...
        stats = quiet(c, removed_chunks=1)
        assert stats["remote_evicted"] >= 1 and stats["remote_known_chunks"] <= 1
        events = events_of(decode(all_batches(daemon, c)))
    ha = expected_hashes(ka, ROOT_KEY, first)
    # ... but the daemon no longer knows it: its chunk is removed, never announced REMOTE.
    assert [(t, m, loc) for t, h, m, loc in placed(events) if h == ha] == [
        ("BlockStored", "CPU", "LOCAL"),
        ("BlockRemoved", "CPU", "LOCAL"),
    ]


@pytest.mark.parametrize(
    "config", [{"events_encoding": "array"}, {"events_remote": False}], ids=["array-encoding", "events-remote-off"]
)
def test_without_remote_announcements_an_evicted_chunk_is_removed(
    daemon_factory: Callable[..., Daemon], redis_server: RedisServer, r: redis.Redis, config: dict[str, Any]
) -> None:
    daemon = remote_daemon(daemon_factory, redis_server, **config)
    tokens = prompt(38, 1)
    with daemon.client(namespace=NS) as c:
        [key] = put_then_evict(c, r, tokens, wait=False)
        stats = quiet(c, removed_chunks=1)
        assert "remote_known_chunks" not in stats and stats["moved_chunks"] == 0
        frames = replay(daemon)  # (all_batches reads maps only)
    events = [e for _, _, payload in frames[1:] for e in msgpack.unpackb(payload, raw=False)[1]]
    h = expected_hashes(key, ROOT_KEY, tokens)
    if config.get("events_encoding") == "array":  # [tag, hashes, parent, ids, size, lora, medium, name]
        assert [(e[0], e[1], e[-1 if e[0] == "BlockRemoved" else 6]) for e in events] == [
            ("BlockStored", h, "CPU"),
            ("BlockRemoved", h, "CPU"),
        ]
    else:
        assert placed(events) == [("BlockStored", h, "CPU", "LOCAL"), ("BlockRemoved", h, "CPU", "LOCAL")]


@pytest.mark.parametrize(
    "key, value",
    [
        ("events_remote", "yes"),
        ("events_remote_max_chunks", 0),
        ("events_remote_max_chunks", 1 << 25),
        ("events_remote_max_chunks", "many"),
        ("events_remote_audit_s", -1),
        ("events_remote_audit_s", 3601),
        ("events_remote_audit_s", "often"),
    ],
)
def test_bad_remote_event_settings_are_refused(key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=key) as err:
        load_config(environ={}, overrides={"events_endpoint": "tcp://127.0.0.1:1", key: value})
    assert repr(value) in str(err.value) or str(value) in str(err.value)


def test_remote_event_settings_defaults() -> None:
    config = load_config(environ={}, overrides={})
    assert (config.events_remote, config.events_remote_max_chunks, config.events_remote_audit_s) == (
        True,
        65536,
        10.0,
    )


# -- the memory of what Redis holds, on its own (a real redis-server, a real RemoteTier) ----------
class Announcements:
    """The announcer's side of forgetting: every key announced REMOTE, and the removals."""

    def __init__(self, remote: set[ChunkKey]):
        self.remote = remote
        self.removed_keys: list[ChunkKey] = []

    def medium(self, key: ChunkKey) -> str | None:
        return REMOTE if key in self.remote else None

    def removed(self, key: ChunkKey) -> None:
        self.remote.discard(key)
        self.removed_keys.append(key)


class CountedTier:
    """The Redis tier, with the size of each EXISTS round trip the audit asks recorded."""

    def __init__(self, tier: RemoteTier):
        self.tier = tier
        self.round_trips: list[int] = []

    @property
    def up(self) -> bool:
        return self.tier.up

    async def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self.round_trips.append(len(keys))
        return await self.tier.exists_many(keys)


def test_the_audit_asks_in_bounded_round_trips_and_ttls_and_the_bound_forget(
    redis_server: RedisServer, r: redis.Redis
) -> None:
    async def main() -> None:
        tier = RemoteTier.redis(redis_server.url)
        await tier.open()
        try:
            keys = [ChunkKey(NS, os.urandom(32)) for _ in range(2500)]
            there = keys[::2]
            r.mset({tier.remote_key(k): b"x" for k in there})
            announced = Announcements(set(keys[:2400]))  # the last 100: known held, not announced REMOTE
            counted = CountedTier(tier)
            held = RemoteHeld(announced, counted, max_chunks=len(keys), ttl_s=0, audit_s=0.05)
            held.written(keys, time.monotonic())
            assert all(held.holds(k) for k in keys)
            task = asyncio.get_running_loop().create_task(held.run())
            while held.stats()["remote_audits"] < 2:
                await asyncio.sleep(0.01)
            task.cancel()
            gone = [k for k in keys[:2400] if k not in set(there)]
            assert sorted(announced.removed_keys) == sorted(gone)  # each withdrawn once
            assert all(held.holds(k) for k in there) and not any(held.holds(k) for k in gone)
            assert len(held) == len(keys) - len(gone)  # the unannounced missing keys are not asked
            assert max(counted.round_trips) <= AUDIT_BATCH and len(counted.round_trips) >= 3

            # A TTL: forgotten (and withdrawn) a margin before Redis expires the key.
            short = RemoteHeld(Announcements(set(keys[:10])), tier, max_chunks=5, ttl_s=2.0, audit_s=0)
            short.written(keys[:10], time.monotonic())
            assert len(short) == 5 and short.stats()["remote_evicted"] == 5  # the bound: oldest first
            assert not any(short.holds(k) for k in keys[:5]) and all(short.holds(k) for k in keys[5:10])
            task = asyncio.get_running_loop().create_task(short.run())
            while len(short):
                await asyncio.sleep(0.01)
            task.cancel()
            assert short.stats()["remote_expired"] == 5 and short.stats()["remote_removed_chunks"] == 10
        finally:
            await tier.close()

    asyncio.run(main())


def test_a_chunk_only_mooncake_holds_is_announced_remote(
    daemon_factory: Callable[..., Daemon], mooncake_master: MooncakeMaster
) -> None:
    """The same as with Redis, on the Mooncake tier: evicted while Mooncake holds it, a chunk
    is announced with locality REMOTE; a get brings it back LOCAL."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    daemon = events_daemon(
        daemon_factory, max_local_cpu_size="4MiB", events_snapshot_endpoint=endpoint, events_remote_audit_s=0,
        **mooncake_master.daemon_config(),
    )  # fmt: skip
    tokens = prompt(37, 2)
    with daemon.client(namespace=NS) as c:
        keys, toks = chunk_keys(tokens, CHUNK), chunk_tokens(tokens, CHUNK)
        assert c.put(keys, [os.urandom(MiB) for _ in keys], tokens=toks) == [PutStatus.STORED] * 2
        wait_for(lambda: c.stats()["tiers"]["mooncake"]["stores"] == 2)
        wait_for(lambda: c.stats()["tiers"]["mooncake"]["queued_writes"] == 0)
        for _ in range(6):
            assert c.put([os.urandom(32)], [os.urandom(MiB)]) == [PutStatus.STORED]
        wait_for(lambda: c.lookup(keys).tiers == ["mooncake"] * 2)
        quiet(c, remote_moved_chunks=2)
        _, frames = snapshot(endpoint)
        assert list(PlacedIndex(BLOCK).apply(frames).state()) == [(TOPIC, "CPU/REMOTE")]
        assert [len(d) for d in c.get(keys)] == [MiB, MiB]  # type: ignore[arg-type]
        quiet(c, moved_chunks=4)
        _, frames = snapshot(endpoint)
        assert list(PlacedIndex(BLOCK).apply(frames).state()) == [(TOPIC, "CPU/LOCAL")]
