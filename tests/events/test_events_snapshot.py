"""KV-event snapshots, heartbeats and epochs (docs/events.md), against the real daemon
and real ZeroMQ sockets:

- a router index rebuilt from a snapshot taken mid-traffic plus the live suffix
  (replayed from the snapshot's sequence + 1) equals the index built from the
  whole stream, under concurrent puts, evictions, spills, promotions and
  deletes (seeded random traffic); the snapshot and the heartbeats are read by
  vLLM's own decoder;
- a restart is a new epoch: a new publisher id, the sequence from 0, the
  topics cleared first; a warm restart announces again what it kept, a router
  that restarts with the daemon converges;
- bad snapshot requests are ignored and the daemon keeps serving; the new
  config fields are checked.
"""

from __future__ import annotations

import os
import random
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from lmcache_client.keys import chunk_keys, chunk_tokens
from lmcache_client.protocol import PutStatus
from lmcache_server.config import ConfigError, load_config
from lmcache_server.events.wire import END_SEQ

from ..conftest import Daemon, free_port, wait_for
from ..integrations.vllm.vllm_harness.fixtures import vllm_python  # noqa: F401 - a fixture
from ..server.events_router import Frames, RouterIndex, snapshot
from .test_events import BLOCK, CHUNK, MODEL, NS, decode_with_vllm, events_daemon, quiet, replay

TOPIC = f"kv@node-a@{MODEL}"


def snapshot_daemon(factory: Callable[..., Daemon], **config: Any) -> Daemon:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    daemon = events_daemon(factory, events_snapshot_endpoint=endpoint, **config)
    daemon.snapshot = endpoint  # type: ignore[attr-defined]
    return daemon


def bootstrap(daemon: Daemon) -> tuple[dict[str, Any], RouterIndex]:
    """A router that starts now: the snapshot, then every batch after it (by replay)."""
    meta, frames = snapshot(daemon.snapshot)  # type: ignore[attr-defined]
    index = RouterIndex(BLOCK).apply(frames)
    return meta, index


def follow(daemon: Daemon, index: RouterIndex, after: int) -> RouterIndex:
    suffix = replay(daemon, after + 1)
    assert [s for _, s, _ in suffix] == list(range(after + 1, after + 1 + len(suffix))), "a gap after the snapshot"
    return index.apply(suffix)


def prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts of 1..4 chunks that share prefixes: some whole chunks, some a few blocks."""
    bases = [[rng.randrange(50_000) for _ in range(4 * CHUNK)] for _ in range(3)]
    out = []
    for _ in range(n):
        p = list(rng.choice(bases)[: rng.randrange(1, 5) * CHUNK])
        cut = rng.randrange(0, len(p) // BLOCK) * BLOCK  # diverge after a whole number of blocks
        p[cut:] = [rng.randrange(50_000) for _ in p[cut:]]
        out.append(p)
    return out


def test_snapshot_plus_suffix_equals_the_whole_stream_under_concurrent_traffic(
    daemon_factory: Callable[..., Daemon],
    tmp_path: Path,
    vllm_python: Path,  # noqa: F811
) -> None:
    daemon = snapshot_daemon(
        daemon_factory,
        local_disk=f"file://{tmp_path / 'spill'}",
        max_local_cpu_size="6MiB",
        max_local_disk_size="12MiB",
        spill_ahead_size=0,
        events_heartbeat_s=0.05,
    )
    rng = random.Random(26)
    size = 256 << 10
    errors: list[BaseException] = []

    def traffic(seed: int) -> None:
        r = random.Random(seed)
        try:
            with daemon.client(namespace=NS) as c:
                for tokens in prompts(r, 60):
                    keys, toks = chunk_keys(tokens, CHUNK), chunk_tokens(tokens, CHUNK)
                    c.put(keys, [os.urandom(size) for _ in keys], tokens=toks)
                    roll = r.random()
                    if roll < 0.2:
                        c.delete(keys[-1:])
                    elif roll < 0.5:
                        c.get(keys[:1])  # from the disk: a promotion, a medium change back
                    elif roll < 0.6:
                        c.put([os.urandom(32)], [os.urandom(size)])  # no token ids: evicts, never announced
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    workers = [threading.Thread(target=traffic, args=(rng.randrange(1 << 30),)) for _ in range(2)]
    for w in workers:
        w.start()
    joined: list[tuple[dict[str, Any], RouterIndex]] = []
    while any(w.is_alive() for w in workers) and len(joined) < 3:
        time.sleep(rng.uniform(0.05, 0.3))
        joined.append(bootstrap(daemon))  # a router joining mid-traffic
    for w in workers:
        w.join(120)
    assert not errors, errors
    with daemon.client(namespace=NS) as c:
        stats = quiet(c, heartbeats=1)  # idle: a heartbeat follows
    assert stats["moved_chunks"] > 0 and stats["removed_chunks"] > 0  # spills, promotions, evictions happened
    whole = RouterIndex(BLOCK).apply(replay(daemon))  # the stream from its first batch
    assert whole.state(), "nothing was announced"
    assert len(joined) >= 1
    for meta, index in joined:
        assert meta["publisher_id"] == stats["publisher_id"]
        assert follow(daemon, index, meta["seq"]).state() == whole.state()
    # A router that starts once the traffic ended: the snapshot alone is the index.
    meta, last = bootstrap(daemon)
    assert last.state() == whole.state() and meta["chunks"] == stats["announced_chunks_now"]
    media = {medium for _, medium in whole.state()}
    assert media == {"CPU", "STORAGE"}
    # vLLM's own decoder reads the snapshot's batches and one stream batch of each kind
    # (event types and media; a heartbeat is a kind), not all: the decoder's run costs test time.
    _, frames = snapshot(daemon.snapshot)  # type: ignore[attr-defined]
    kinds: dict[frozenset[tuple[str, str]], Frames] = {}
    for frame in replay(daemon):
        kind = frozenset((e["type"], e.get("medium", "")) for e in msgpack.unpackb(frame[2], raw=False)[1])
        kinds.setdefault(kind, frame)
    stream = list(kinds.values())
    assert len(stream) >= 5
    decoded = decode_with_vllm(vllm_python, frames + stream)
    assert len(decoded) == len(frames) + len(stream)
    assert {e["type"] for b in decoded[: len(frames)] for e in b["events"]} == {"BlockStored"}
    assert {e["locality"] for b in decoded for e in b["events"] if e["type"] != "AllBlocksCleared"} == {"LOCAL"}
    assert whole.heartbeats > 0 and any(not b["events"] for b in decoded)


def test_a_restart_is_a_new_epoch_and_a_warm_one_announces_what_it_kept(
    daemon_factory: Callable[..., Daemon],
) -> None:
    daemon = snapshot_daemon(daemon_factory, warm_restart=True, max_local_cpu_size="8MiB")
    tokens = [i % 50_000 for i in range(3 * CHUNK)]
    keys, toks = chunk_keys(tokens, CHUNK), chunk_tokens(tokens, CHUNK)
    with daemon.client(namespace=NS) as c:
        assert c.put(keys, [b"x" * 4096] * 3, tokens=toks) == [PutStatus.STORED] * 3
        before = quiet(c, announced_chunks=3)
    meta, router = bootstrap(daemon)
    old = router.state()
    assert [len(blocks) for blocks in old.values()] == [3 * CHUNK // BLOCK]
    assert daemon.stop() == 0
    daemon.start()  # the same config: the memory tier is adopted
    with daemon.client(namespace=NS) as c:
        after = quiet(c, restored_chunks=3)
    assert after["publisher_id"] != before["publisher_id"]
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10).read().decode()
    assert "lmcache_event_chunks_restored_total 3.0" in metrics
    assert f"lmcache_event_kept_bytes {float(after['kept_bytes'])}" in metrics and after["kept_bytes"] > 0
    stream = replay(daemon)
    assert stream[0][1] == after["first_seq"] >= before["next_seq"]  # a new epoch, numbered past the old one
    first = [msgpack.unpackb(p, raw=False)[1] for t, _, p in stream if t == TOPIC.encode()][0]
    # Drop the old epoch's blocks, then what the warm restart kept, with its medium ...
    assert [(e["type"], e.get("medium")) for e in first] == [("AllBlocksCleared", None)] + [("BlockStored", "CPU")] * 3
    # ... and the router that follows the new stream has them again, as does a new snapshot.
    assert router.apply(stream).state() == old
    meta2, fresh = bootstrap(daemon)
    assert meta2["publisher_id"] == after["publisher_id"] and fresh.state() == old
    # A cold restart (no disk, warm restart off): the topic is cleared and nothing comes back.
    daemon.stop()
    daemon.config["warm_restart"] = False
    daemon.start()
    with daemon.client(namespace=NS) as c:
        assert quiet(c)["restored_chunks"] == 0
    assert router.apply(replay(daemon)).state() == {}


def test_bad_snapshot_requests_are_ignored_and_the_daemon_keeps_serving(
    daemon_factory: Callable[..., Daemon],
) -> None:
    daemon = snapshot_daemon(daemon_factory)
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(daemon.snapshot)  # type: ignore[attr-defined]
        sock.send_multipart([b"", b"x" * 5000])  # a prefix too long
        sock.send_multipart([b"", b"a", b"b"])  # too many frames
        assert not sock.poll(300)
    meta, frames = snapshot(daemon.snapshot, prefix=b"kv@other")  # type: ignore[attr-defined]
    assert frames == [] and meta["chunks"] == 0
    with daemon.client(namespace=NS) as c:
        assert c.stats()["events"]["snapshot_bad_requests"] == 2
        assert c.put([os.urandom(32)], [b"x"]) == [PutStatus.STORED]


def test_snapshot_and_heartbeat_config_is_checked() -> None:
    env: dict[str, str] = {}
    with pytest.raises(ConfigError, match="events_heartbeat_s"):
        load_config(environ=env, overrides={"events_endpoint": "tcp://127.0.0.1:1", "events_heartbeat_s": -1})
    with pytest.raises(ConfigError, match="events_heartbeat_s"):
        load_config(environ=env, overrides={"events_endpoint": "tcp://127.0.0.1:1", "events_heartbeat_s": "often"})
    with pytest.raises(ConfigError, match="events_snapshot_endpoint.*unset unless events_endpoint"):
        load_config(environ=env, overrides={"events_snapshot_endpoint": "tcp://127.0.0.1:1"})
    for bad in (0, -1, 3601, "long"):
        with pytest.raises(ConfigError, match="events_snapshot_timeout_s"):
            load_config(environ=env, overrides={"events_snapshot_timeout_s": bad})
    config = load_config(environ=env, overrides={"events_endpoint": "tcp://127.0.0.1:1"})
    assert config.events_heartbeat_s == 1.0 and config.events_snapshot_endpoint is None
    assert config.events_snapshot_timeout_s == 60.0


def test_an_exposed_snapshot_endpoint_needs_allow_insecure(daemon_factory: Callable[..., Daemon]) -> None:
    with pytest.raises(RuntimeError, match="events_snapshot_endpoint.*token ids"):
        daemon_factory(
            events_endpoint=f"tcp://127.0.0.1:{free_port()}", events_snapshot_endpoint=f"tcp://*:{free_port()}"
        )


def test_a_slow_snapshot_reader_loses_the_slot_at_the_deadline_and_the_next_is_answered(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Issue 39 item 9: the endpoint answers one snapshot at a time, and a reader that takes
    ten batches every 0.5 s (never stalling for ``STALL_S``; over a minute for this
    snapshot) held that slot for as long as it liked: the second reader waited for it.
    Now ``events_snapshot_timeout_s`` (4 s here) bounds each snapshot: the slow reader
    loses the rest (no end marker) and the second reader gets its whole snapshot.  One
    event per batch, 2,000 chunks of 1,024 five-byte token ids: ~12 MB of batches, more
    than ZeroMQ and the kernel queue (~2 MB) for a reader that does not keep up."""
    chunk = 1024
    ns = NS.replace(f"|c{CHUNK}", f"|c{chunk}")
    daemon = snapshot_daemon(
        daemon_factory,
        chunk_size=chunk,
        events_batch_max_events=1,
        events_snapshot_timeout_s=4.0,
        max_local_cpu_size="64MiB",
    )
    rng = random.Random(39)
    n = 2000
    with daemon.client(namespace=ns) as c:
        for _ in range(n // 200):
            ids = [rng.randrange(1 << 28, 1 << 31) for _i in range(200 * chunk)]
            keys, toks = chunk_keys(ids, chunk), chunk_tokens(ids, chunk)
            assert c.put(keys, [b"x" * 64] * len(keys), tokens=toks) == [PutStatus.STORED] * len(keys)
        quiet(c, announced_chunks=n)
    stop = threading.Event()
    slow_got: list[bytes] = []

    def slow_reader() -> None:
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RCVBUF, 4096)
            sock.connect(daemon.snapshot)  # type: ignore[attr-defined]
            sock.send_multipart([b"", b""])
            while not stop.wait(0.5):  # ten batches every half second: it never stalls for STALL_S
                for _ in range(10):
                    if sock.poll(100):
                        slow_got.append(sock.recv_multipart()[2])

    thread = threading.Thread(target=slow_reader, daemon=True)
    thread.start()
    try:
        wait_for(lambda: slow_got)  # its snapshot has begun
        meta, frames = snapshot(daemon.snapshot, timeout_ms=30_000)  # type: ignore[attr-defined]
        assert meta["chunks"] == n and len(frames) == n  # the second reader's, whole
        assert END_SEQ not in slow_got  # the slow one lost the rest
        with daemon.client(namespace=ns) as c:
            stats = c.stats()["events"]
            assert stats["snapshots_timed_out"] == 1 and stats["snapshots"] == 1
    finally:
        stop.set()
        thread.join(10)
