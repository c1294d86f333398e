"""Chunks announced from the token ids their records carry (storage/chunkfile.py format 2;
docs/events.md "What is announced"), against real daemons, a real redis-server and
real ZeroMQ sockets:

- after a clean stop (the kept file) and after a crash (SIGKILL: no kept file,
  the records' token ids), the chunks the disk tier finds are announced again,
  with the same blocks and medium a router had before;
- a chunk that one node put reaches another through the shared Redis tier: the
  second node announces it when a read promotes it, with the same block hashes
  and token ids as the first node's announcement (another node's chunk, not
  only its own);
- ``record_tokens: false`` writes format 1 records (what older daemons read):
  nothing is announced from them; a daemon without events reads format 2;
- the kept file of an older daemon (no parent keys) still loads.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable
from pathlib import Path

import msgpack
import redis

from lmcache_client import CacheClient
from lmcache_client.keys import chunk_keys, chunk_tokens
from lmcache_client.protocol import PutStatus
from lmcache_server.events import keep
from lmcache_server.events.blocks import block_hashes
from lmcache_server.storage.chunkfile import encode_record

from ..conftest import Daemon, RedisServer, wait_for
from ..server.events_router import RouterIndex
from .test_events import BLOCK, CHUNK, MODEL, NS, events_daemon, quiet, replay
from .test_events_snapshot import bootstrap, snapshot_daemon

SPILLING = {"max_local_cpu_size": "4MiB", "max_local_disk_size": "64MiB", "spill_ahead_size": 0}
"""A 4 MiB pool over a disk tier: 1 MiB chunks spill at once."""


def put_to_disk(c: CacheClient, tokens: list[int]) -> list[bytes]:
    """Put ``tokens``' chunks (1 MiB each) with their token ids, then push them to the disk
    with token-less puts (never announced); returns their keys once their medium moved."""
    keys, toks = chunk_keys(tokens, CHUNK), chunk_tokens(tokens, CHUNK)
    assert c.put(keys, [os.urandom(1 << 20)] * len(keys), tokens=toks) == [PutStatus.STORED] * len(keys)
    moved = int(c.stats()["events"]["moved_chunks"])
    for _ in range(6):
        c.put([os.urandom(32)], [os.urandom(1 << 20)])
    wait_for(lambda: c.lookup(keys).tiers == ["disk"] * len(keys))
    quiet(c, moved_chunks=moved + len(keys))
    wait_for(lambda: c.stats()["tiers"]["disk"]["queued_spills"] == 0)
    return keys


def test_chunks_found_on_disk_at_a_cold_start_are_announced_with_their_medium(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """After a clean stop (what was announced is kept) the cold start announces the
    chunks its disk found, ``STORAGE``, as a router had them."""
    daemon = snapshot_daemon(daemon_factory, local_disk=f"file://{tmp_path / 'spill'}", **SPILLING)
    with daemon.client(namespace=NS) as c:
        put_to_disk(c, [(i * 7) % 50_000 for i in range(2 * CHUNK)])
    _, router = bootstrap(daemon)
    assert {medium for _, medium in router.state()} == {"STORAGE"}
    assert daemon.stop() == 0
    daemon.start()  # cold: memory is empty, the disk tier finds its files
    with daemon.client(namespace=NS) as c:
        assert quiet(c, restored_chunks=2)["restored_chunks"] == 2
    _, fresh = bootstrap(daemon)
    assert fresh.state() == router.state()
    assert router.apply(replay(daemon)).state() == fresh.state()  # the restarted subscriber converges


def test_chunks_on_disk_after_a_crash_are_announced_from_their_records(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = snapshot_daemon(daemon_factory, local_disk=f"file://{tmp_path / 'spill'}", warm_restart=False, **SPILLING)
    with daemon.client(namespace=NS) as c:
        put_to_disk(c, [(i * 11) % 50_000 for i in range(3 * CHUNK)])
    _, router = bootstrap(daemon)
    assert {medium for _, medium in router.state()} == {"STORAGE"}
    assert sum(len(b) for b in router.state().values()) == 3 * CHUNK // BLOCK
    daemon.kill()  # a crash: no kept file, no disk index snapshot
    assert not list((tmp_path / "spill").glob("events-kept*"))
    daemon.start()
    with daemon.client(namespace=NS) as c:
        stats = quiet(c, restored_chunks=3)
        assert stats["restored_chunks"] == 3 and stats["announced_chunks"] == 0
        assert c.stats()["tiers"]["disk"]["rebuilt_from_snapshot"] == 0  # the scan found them
    _, fresh = bootstrap(daemon)
    assert fresh.state() == router.state()
    assert router.apply(replay(daemon)).state() == fresh.state()  # the subscriber that saw the crash converges


def redis_of(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url)


def two_nodes(factory: Callable[..., Daemon], server: RedisServer, **config: object) -> tuple[Daemon, Daemon]:
    common = {"remote_url": server.url, "max_local_cpu_size": "64MiB", **config}
    return (
        snapshot_daemon(factory, node="node-a", **common),
        snapshot_daemon(factory, node="node-b", **common),
    )


def written_to_redis(server: RedisServer, n: int) -> list[bytes]:
    r = redis_of(server)
    wait_for(lambda: len(r.keys("lmcache:*")) >= n)
    return [r.get(k) for k in r.keys("lmcache:*")]  # type: ignore[misc]


def test_a_chunk_promoted_from_redis_is_announced_by_the_node_that_read_it(
    daemon_factory: Callable[..., Daemon], redis_server: RedisServer
) -> None:
    a, b = two_nodes(daemon_factory, redis_server)
    tokens = [(i * 13) % 50_000 for i in range(2 * CHUNK)]
    keys, toks = chunk_keys(tokens, CHUNK), chunk_tokens(tokens, CHUNK)
    payloads = [os.urandom(1 << 16) for _ in keys]
    with a.client(namespace=NS) as c:
        assert c.put(keys, payloads, tokens=toks) == [PutStatus.STORED] * 2
        quiet(c, announced_chunks=2)
    records = written_to_redis(redis_server, 2)
    assert {struct.unpack_from("<H", r, 4)[0] for r in records} == {2}  # format 2: with token ids
    _, router_a = bootstrap(a)
    with b.client(namespace=NS) as c:
        assert quiet(c)["announced_chunks"] == 0
        got = c.get(keys)
        assert [bytes(g) for g in got] == payloads  # type: ignore[arg-type]
        assert c.lookup(keys).tiers == ["memory", "memory"]  # promoted
        stats = quiet(c, announced_chunks=2)
        assert stats["announced_chunks"] == 2 and stats["skipped_chunks"] == 0
    _, router_b = bootstrap(b)
    assert len(router_a.state()) == 1
    as_b = {(t.replace("node-a", "node-b"), m): blocks for (t, m), blocks in router_a.state().items()}
    assert router_b.state() == as_b  # same blocks, parents, token ids and medium (CPU)
    assert list(as_b) == [(f"kv@node-b@{MODEL}", "CPU")]


def test_record_tokens_off_writes_format_1_and_nothing_is_announced_from_it(
    daemon_factory: Callable[..., Daemon], redis_server: RedisServer
) -> None:
    a, b = two_nodes(daemon_factory, redis_server, record_tokens=False)
    tokens = [(i * 17) % 50_000 for i in range(CHUNK)]
    keys, toks = chunk_keys(tokens, CHUNK), chunk_tokens(tokens, CHUNK)
    with a.client(namespace=NS) as c:
        assert c.put(keys, [os.urandom(4096)], tokens=toks) == [PutStatus.STORED]
        quiet(c, announced_chunks=1)
    (record,) = written_to_redis(redis_server, 1)
    assert struct.unpack_from("<HH", record, 4)[0] == 1 and struct.unpack_from("<I", record, 60)[0] == 0
    with b.client(namespace=NS) as c:
        assert c.get(keys)[0] is not None
        assert c.lookup(keys).tiers == ["memory"]
        assert quiet(c)["announced_chunks"] == 0
    assert RouterIndex(BLOCK).apply(replay(b)).state() == {}


def test_an_events_daemon_without_record_tokens_still_takes_records_with_them(
    daemon_factory: Callable[..., Daemon], redis_server: RedisServer
) -> None:
    """A fleet mid-upgrade: records with token ids are read by any current daemon,
    whatever its own ``record_tokens`` (and without events)."""
    a = events_daemon(daemon_factory, remote_url=redis_server.url, max_local_cpu_size="64MiB")
    b = daemon_factory(remote_url=redis_server.url, max_local_cpu_size="64MiB")
    tokens = [(i * 19) % 50_000 for i in range(CHUNK)]
    keys, toks = chunk_keys(tokens, CHUNK), chunk_tokens(tokens, CHUNK)
    payload = os.urandom(8192)
    with a.client(namespace=NS) as c:
        assert c.put(keys, [payload], tokens=toks) == [PutStatus.STORED]
    written_to_redis(redis_server, 1)
    with b.client(namespace=NS) as c:
        assert bytes(c.get(keys)[0]) == payload  # type: ignore[arg-type]
        assert c.stats()["tiers"]["redis"]["corrupt"] == 0


def test_kept_records_are_announced_only_when_their_ids_hash_to_their_keys(tmp_path: Path) -> None:
    """Only what ``chain_key(parent key, ids) == key`` proves is announced from a kept file
    (issue 39): a record of the older format (no parent key, so nothing to check it with)
    or one whose ids are not its key's is dropped with one line; block hashes are computed
    again from the ids, never taken from the file."""
    tokens = [(i * 23) % 50_000 for i in range(CHUNK)]
    (key,), (tok,) = chunk_keys(tokens, CHUNK), chunk_tokens(tokens, CHUNK)
    assert tok is not None
    hashes = block_hashes(key, tok.parent, tok.packed, BLOCK)
    packed_hashes = struct.pack(f"<{len(hashes)}Q", *hashes)
    old = tmp_path / "old.msgpack"
    old.write_bytes(keep.HEADER_V1 + msgpack.packb((NS, key, -1, packed_hashes, tok.packed), use_bin_type=True))
    assert keep.load(old) == [] and not old.exists()
    other = [(i * 7) % 50_000 for i in range(CHUNK)]
    (forged,) = chunk_tokens(other, CHUNK)
    assert forged is not None
    lying = tmp_path / "lying.msgpack"  # another prompt's ids under this key
    lying.write_bytes(keep.HEADER + msgpack.packb((NS, key, -1, packed_hashes, forged.packed, forged.parent)))
    assert keep.load(lying) == []
    wrong_hashes = struct.pack(f"<{len(hashes)}Q", *range(len(hashes)))
    good = tmp_path / "good.msgpack"
    good.write_bytes(keep.HEADER + msgpack.packb((NS, key, 12345, wrong_hashes, tok.packed, tok.parent)))
    (kept,) = keep.load(good)
    assert kept.key.digest == key and list(kept.held.hashes) == hashes and kept.held.parent is None
    new = tmp_path / "new.msgpack"
    assert keep.save(new, [kept]) == 1
    assert (new.stat().st_mode & 0o777) == 0o600
    (again,) = keep.load(new)
    assert again.held.parent_key == tok.parent and again.held.packed == tok.packed
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(keep.HEADER + msgpack.packb((NS, key, -1, packed_hashes, tok.packed, b"short"), use_bin_type=True))
    assert keep.load(bad) == []  # a damaged record: logged, nothing announced from it


def test_a_chunk_put_again_while_only_the_disk_holds_it_is_announced_in_memory_again(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """A put (with or without token ids) of a chunk announced ``STORAGE`` stores it in
    memory again: its medium moves back to ``CPU``, as a promotion's does."""
    daemon = events_daemon(daemon_factory, local_disk=f"file://{tmp_path / 'spill'}", **SPILLING)
    tokens = [(i * 29) % 50_000 for i in range(2 * CHUNK)]
    toks = chunk_tokens(tokens, CHUNK)
    with daemon.client(namespace=NS) as c:
        keys = put_to_disk(c, tokens)
        assert c.put(keys[:1], [os.urandom(1 << 20)]) == [PutStatus.STORED]  # no token ids
        assert c.put(keys[1:], [os.urandom(1 << 20)], tokens=toks[1:]) == [PutStatus.STORED]
        assert c.lookup(keys).tiers == ["memory", "memory"]
        quiet(c, moved_chunks=4)
    router = RouterIndex(BLOCK).apply(replay(daemon))
    assert list(router.state()) == [(f"kv@node-a@{MODEL}", "CPU")]
    assert sum(len(b) for b in router.state().values()) == 2 * CHUNK // BLOCK


def test_a_record_with_more_than_one_chunks_token_ids_is_served_but_not_announced(
    daemon_factory: Callable[..., Daemon], redis_server: RedisServer
) -> None:
    """Issue 39 item 9: a record in Redis (or on disk) may claim up to 2**20 token ids
    while a put carries exactly one chunk's.  A record whose ids hash to its key but
    are four chunks' worth (a whole number of blocks), and one whose ids are one
    chunk of the daemon's but not of its namespace's ``c<N>``, are served, and not
    announced; a record of one chunk's ids is announced as before."""
    a, b = two_nodes(daemon_factory, redis_server)
    tokens = [(i * 29) % 50_000 for i in range(CHUNK)]
    keys, toks = chunk_keys(tokens, CHUNK), chunk_tokens(tokens, CHUNK)
    with a.client(namespace=NS) as c:
        assert c.put(keys, [os.urandom(4096)], tokens=toks) == [PutStatus.STORED]
    written_to_redis(redis_server, 1)
    r = redis_of(redis_server)
    (name,) = r.keys("lmcache:*")
    prefix = name.rsplit(b":", 1)[0] + b":"  # the key prefix and NS's tag (storage/remote/link.py)
    long_ids = [(i * 31) % 50_000 for i in range(4 * CHUNK)]
    (long_key,), (long_tok,) = chunk_keys(long_ids, 4 * CHUNK), chunk_tokens(long_ids, 4 * CHUNK)
    payload = os.urandom(4096)
    r.set(prefix + long_key.hex().encode(), bytes(encode_record(NS, long_key, payload, long_tok)))
    small_ns = NS.replace(f"|c{CHUNK}", f"|c{CHUNK // 4}")  # names chunks of 64 tokens
    ids = [(i * 37) % 50_000 for i in range(CHUNK)]
    (other_key,), (other_tok,) = chunk_keys(ids, CHUNK), chunk_tokens(ids, CHUNK)
    small_prefix = name[: -(16 + 1 + 64)] + hashlib.sha256(small_ns.encode()).hexdigest()[:16].encode() + b":"
    r.set(small_prefix + other_key.hex().encode(), bytes(encode_record(small_ns, other_key, payload, other_tok)))
    with b.client(namespace=NS) as c:
        got = c.get([keys[0], long_key])
        assert got[1] is not None and bytes(got[1]) == payload  # served, promoted
        assert c.get([other_key], namespace=small_ns)[0] is not None
        assert c.lookup([keys[0], long_key]).tiers == ["memory", "memory"]
        stats = dict(wait_for(lambda: (s := quiet(c))["announced_chunks"] + s["skipped_chunks"] >= 3 and s))
        assert (stats["announced_chunks"], stats["skipped_chunks"]) == (1, 2)
    _, router = bootstrap(b)
    ((_, blocks),) = router.state().items()
    assert len(blocks) == CHUNK // BLOCK  # one chunk's blocks: the put's, not the long record's
