"""Eviction under pressure: the pool bound holds, LRU order, leased chunks stay intact."""

from __future__ import annotations

import os
import time

import msgpack
import zmq

from lmcache_client import PutStatus
from lmcache_client.protocol import KEY_BYTES

from ...conftest import NAMESPACE

MiB = 1 << 20


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_lru_eviction_keeps_pool_bound(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory(max_local_cpu_size="16MiB", cache_policy="lru")
    with daemon.client() as c:
        keys = [os.urandom(KEY_BYTES) for _ in range(64)]
        payloads = [os.urandom(MiB) for _ in keys]
        for key, data in zip(keys, payloads):
            assert c.put([key], [data]) == [PutStatus.STORED]
            mem = c.stats()["tiers"]["memory"]
            assert mem["allocated_bytes"] <= mem["capacity_bytes"] == 16 * MiB
            assert mem["stored_bytes"] <= mem["allocated_bytes"]
        mem = c.stats()["tiers"]["memory"]
        assert mem["chunks"] == 16  # 1 MiB chunks are page multiples: exactly 16 fit
        assert mem["evictions"] == 64 - mem["chunks"]
        present = c.exists(keys)
        # LRU: exactly the most recent chunks survive, and they hold the right bytes.
        n = mem["chunks"]
        assert present == [False] * (64 - n) + [True] * n
        got = c.get(keys[-n:])
        assert [bytes(g) for g in got if g is not None] == payloads[-n:]


def test_get_refreshes_recency(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory(max_local_cpu_size="8MiB")
    with daemon.client() as c:
        hot = os.urandom(KEY_BYTES)
        c.put([hot], [os.urandom(MiB)])
        for _ in range(40):
            c.put([os.urandom(KEY_BYTES)], [os.urandom(MiB)])
            assert c.get([hot])[0] is not None  # each read makes it most recent


def test_rss_stays_within_pool_under_churn(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory(max_local_cpu_size="32MiB")
    base = rss_bytes(daemon.proc.pid)
    with daemon.client() as c:
        for _ in range(60):  # 480 MiB through a 32 MiB pool
            batch = [os.urandom(KEY_BYTES) for _ in range(8)]
            c.put(batch, [os.urandom(MiB)] * 8)
            c.get(batch)
    grown = rss_bytes(daemon.proc.pid) - base
    # The pool (32 MiB) plus receive buffers of about one request (8 MiB) and slack.
    assert grown < 32 * MiB + 8 * MiB + 24 * MiB, f"RSS grew by {grown / MiB:.1f} MiB"


def test_chunk_being_sent_is_never_overwritten(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A reader that does not drain its socket keeps its chunks leased; eviction
    under a put storm must skip them, and the reader finally gets the right bytes."""
    daemon = daemon_factory(max_local_cpu_size="40MiB")
    keys = [os.urandom(KEY_BYTES) for _ in range(6)]
    payloads = [os.urandom(4 * MiB) for _ in keys]
    with daemon.client() as writer:
        assert writer.put(keys, payloads) == [PutStatus.STORED] * 6

        ctx = zmq.Context.instance()
        slow = ctx.socket(zmq.DEALER)
        slow.setsockopt(zmq.LINGER, 0)
        slow.setsockopt(zmq.RCVBUF, 32 * 1024)
        slow.setsockopt(zmq.RCVHWM, 1)
        slow.connect(daemon.address)
        try:
            header = {"v": 1, "op": "get", "id": 7, "ns": NAMESPACE, "keys": keys}
            slow.send(msgpack.packb(header, use_bin_type=True))
            # Wait until the daemon has answered (the reply is stuck in transit).
            deadline = time.monotonic() + 10
            while writer.stats()["tiers"]["memory"]["leased_chunks"] == 0:
                assert time.monotonic() < deadline, "get reply never started"
                time.sleep(0.01)
            # Storm: 200 MiB of new chunks through a 40 MiB pool.
            for _ in range(50):
                writer.put([os.urandom(KEY_BYTES)], [os.urandom(4 * MiB)])
            assert slow.poll(10_000), "no reply"
            frames = slow.recv_multipart()
            reply = msgpack.unpackb(frames[0])
            assert reply["ok"] and reply["found"] == [True] * 6
            assert frames[1:] == payloads
        finally:
            slow.close(0)
        # Leases end once the reply is sent.
        deadline = time.monotonic() + 10
        while writer.stats()["tiers"]["memory"]["leased_chunks"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)


def test_delete_while_leased_frees_after_send(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory(max_local_cpu_size="16MiB")
    with daemon.client() as c:
        key = [os.urandom(KEY_BYTES)]
        c.put(key, [os.urandom(4 * MiB)])
        ctx = zmq.Context.instance()
        slow = ctx.socket(zmq.DEALER)
        slow.setsockopt(zmq.LINGER, 0)
        slow.setsockopt(zmq.RCVBUF, 16 * 1024)
        slow.connect(daemon.address)
        try:
            slow.send(msgpack.packb({"v": 1, "op": "get", "id": 1, "ns": NAMESPACE, "keys": key}))
            time.sleep(0.3)
            assert c.delete(key) == [True]
            assert c.exists(key) == [False]
            slow.recv_multipart()
        finally:
            slow.close(0)
        deadline = time.monotonic() + 10
        while c.stats()["tiers"]["memory"]["allocated_bytes"]:
            assert time.monotonic() < deadline, "extent of a deleted, leased chunk never freed"
            time.sleep(0.01)


def test_no_space_refusal_evicts_nothing(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """When pinned chunks leave too little room, a put is refused without
    evicting the unpinned chunks for nothing."""
    daemon = daemon_factory(max_local_cpu_size="8MiB", max_pinned_fraction=1.0)
    with daemon.client() as c:
        pinned = [os.urandom(KEY_BYTES) for _ in range(6)]
        c.put(pinned, [os.urandom(MiB)] * 6)
        assert c.pin(pinned) == [True] * 6
        loose = [os.urandom(KEY_BYTES)]
        c.put(loose, [os.urandom(MiB)])
        assert c.put([os.urandom(KEY_BYTES)], [os.urandom(3 * MiB)]) == [PutStatus.NO_SPACE]
        assert c.exists(loose) == [True]
        assert c.stats()["tiers"]["memory"]["evictions"] == 0
        assert c.put([os.urandom(KEY_BYTES)], [os.urandom(9 * MiB)]) == [PutStatus.TOO_LARGE]
