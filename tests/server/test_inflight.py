"""In-flight limits: the byte budget answers BUSY; clients handle BUSY and limits."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from lmcache_client import ErrorCode, PutStatus, ServerError
from lmcache_client.calls import _put_status
from lmcache_client.protocol import KEY_BYTES

from ..conftest import NAMESPACE

MiB = 1 << 20


_STALLED_READER = """
import os, signal, sys, msgpack, zmq
address, ns, keys = sys.argv[1], sys.argv[2], [bytes.fromhex(k) for k in sys.argv[3:]]
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.connect(address)
header = msgpack.packb({"v": 1, "op": "get", "id": 1, "ns": ns, "keys": keys})
# Tracked and zero-copy: done once libzmq has written the request to the socket.
tracker = sock.send(zmq.Frame(header, copy=False, track=True), copy=False, track=True)
tracker.wait(10)
print("sent", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops: nobody reads the reply
"""


def test_budget_spent_by_unsent_replies_answers_busy(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory(max_local_cpu_size="128MiB", max_inflight_bytes="32MiB", max_message_size="32MiB")
    keys = [os.urandom(KEY_BYTES) for _ in range(2)]
    small = [os.urandom(KEY_BYTES)]
    # Payload frames: shared-memory gets move no bytes through the socket (test_shm.py).
    with daemon.client(shared_memory=False) as c, daemon.client(fail_open=True, shared_memory=False) as lenient:
        for key in keys:
            c.put([key], [os.urandom(16 * MiB)])
        c.put(small, [os.urandom(MiB)])
        # A reader stopped right after its request: its 32 MiB reply cannot leave
        # the daemon (a unix socket buffers a few hundred KiB), so its bytes stay
        # in flight until the reader dies.
        reader = subprocess.Popen(
            [sys.executable, "-c", _STALLED_READER, daemon.ipc_address, NAMESPACE, *(k.hex() for k in keys)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert reader.stdout is not None and reader.stdout.readline().strip() == "sent"
            deadline = time.monotonic() + 10
            while c.stats()["server"]["inflight_bytes"] < 16 * MiB:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            # Its reply was cut to its fair share, half the budget: one of the two chunks.
            assert c.stats()["server"]["inflight_bytes"] == 16 * MiB
            # Half of the rest is too little for a 16 MiB chunk: BUSY ...
            with pytest.raises(ServerError) as info:
                c.get(keys[1:])
            assert info.value.code == ErrorCode.BUSY
            assert lenient.get(keys[1:]) == [None]  # fail-open: BUSY is a miss
            assert lenient.busy_replies == 1 and lenient.failures == 0
            # ... while a smaller chunk is served, and requests without payload pass.
            assert c.get(small)[0] is not None
            assert c.exists(small) == [True]
        finally:
            reader.kill()
            reader.wait(10)
        # The reader's connection is gone: the daemon drops its reply and frees the budget.
        deadline = time.monotonic() + 20
        while c.stats()["server"]["inflight_bytes"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert c.get(small)[0] is not None
    metrics = daemon_metrics(daemon.metrics_port)
    assert "lmcache_busy_rejections_total 2.0" in metrics  # the strict and the lenient client


def daemon_metrics(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def test_oversized_request_from_client_fails_fast(daemon) -> None:  # type: ignore[no-untyped-def]
    """A header too large to decode still gets a reply the client can match."""
    with daemon.client(timeout_s=60) as c:
        # A reply the client could not match would surface as DaemonUnavailable
        # after the timeout; a matched one is a ServerError.
        with pytest.raises(ServerError) as info:
            c.lookup([os.urandom(KEY_BYTES) for _ in range(6000)])
        assert info.value.code == ErrorCode.TOO_LARGE


def test_unknown_put_status_is_kept_as_int() -> None:
    assert _put_status(0) is PutStatus.STORED
    assert _put_status(99) == 99


def test_http_endpoints(daemon) -> None:  # type: ignore[no-untyped-def]
    import urllib.error
    import urllib.request

    base = f"http://127.0.0.1:{daemon.metrics_port}"
    with urllib.request.urlopen(base + "/healthz", timeout=5) as r:
        assert r.status == 200
    with urllib.request.urlopen(base + "/readyz", timeout=5) as r:
        assert r.status == 200
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(base + "/nope", timeout=5)
    assert info.value.code == 404
    with daemon.client() as c:
        key = [os.urandom(KEY_BYTES)]
        c.put(key, [b"x" * 1000])
        c.get(key)
        c.get([os.urandom(KEY_BYTES)])
        c.lookup(key)
    text = daemon_metrics(daemon.metrics_port)
    assert 'lmcache_requests_total{op="put",outcome="ok"} 1.0' in text
    assert 'lmcache_tier_hits_total{tier="memory"} 1.0' in text
    assert 'lmcache_tier_misses_total{tier="memory"} 1.0' in text
    assert 'lmcache_tier_stored_bytes{tier="memory"} 1000.0' in text
    assert "lmcache_lookup_hit_chunks_total 1.0" in text
    assert 'lmcache_request_duration_seconds_bucket{le="+Inf",op="get"} 2.0' in text
