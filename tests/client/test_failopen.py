"""Fail-open against a real daemon that goes away, drains or comes back.

What an outage costs is counted, not timed: ``failures`` counts requests
that got no usable answer (each cost at most its timeout), ``short_circuited``
data ops the open breaker answered without sending anything.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from lmcache_client import CacheClient, DaemonUnavailable, PutStatus
from lmcache_client.protocol import KEY_BYTES

from ..conftest import NAMESPACE, Daemon, wait_for
from ..server.test_inflight import _STALLED_READER

MiB = 1 << 20


def test_an_outage_costs_one_timeout_then_short_probes(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory()
    key = [os.urandom(KEY_BYTES)]
    opts = {"timeout_s": 2.0, "backoff_s": 0.3, "max_backoff_s": 1.0, "probe_timeout_s": 0.1}
    with CacheClient(daemon.address, NAMESPACE, **opts) as c:  # type: ignore[arg-type]
        assert c.put(key, [b"v1"]) == [PutStatus.STORED]
        daemon.stop()
        for _ in range(25):
            assert c.get(key) == [None] and c.lookup(key).hit_chunks == 0
            assert c.put(key, [b"x" * MiB]) == [PutStatus.FAILED]  # the shared-memory path too
        # One request ran into its timeout; 74 data ops were answered without a request.
        assert c.failures == 1 and c.short_circuited == 74
        stats = c.fail_open_stats
        assert stats["down"] and stats["outages"] == 1
        with pytest.raises(DaemonUnavailable):  # admin ops are never short-circuited
            c.stats()
        # Past the back-off the next data op probes once (a 0.1 s ping), finds nothing
        # and the breaker opens again: the probe is the only request it cost.
        time.sleep(0.35)
        failures = c.failures
        assert c.get(key) == [None]
        assert c.failures == failures + 1
        daemon.start()
        # Hits come back by themselves, within a back-off or two.
        wait_for(lambda: c.put(key, [b"v2"]) == [PutStatus.STORED], 10)
        assert bytes(c.get(key)[0]) == b"v2"
        assert c.fail_open_stats["down"] is False and c.fail_open_stats["outages"] == 1


def test_fail_open_off_raises_every_time(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory()
    with CacheClient(daemon.address, NAMESPACE, timeout_s=0.3, fail_open=False) as c:
        daemon.stop()
        for _ in range(2):
            with pytest.raises(DaemonUnavailable):
                c.get([os.urandom(KEY_BYTES)])
        assert c.failures == 2 and c.short_circuited == 0


@pytest.mark.parametrize("shared_memory", [False, True], ids=["frames", "shm"])
def test_a_draining_daemon_is_a_miss(daemon_factory: Callable[..., Daemon], shared_memory: bool) -> None:
    """Issue #14.1: SHUTTING_DOWN answers during a graceful drain fail open like an outage."""
    daemon = daemon_factory(max_local_cpu_size="128MiB", drain_timeout_s=30)
    big = [os.urandom(KEY_BYTES) for _ in range(2)]
    key = [os.urandom(KEY_BYTES)]
    with daemon.client(shared_memory=False) as setup:
        for k in big:
            setup.put([k], [os.urandom(16 * MiB)])
        setup.put(key, [os.urandom(MiB)])
    # A stopped reader keeps a 32 MiB reply in flight, so the drain lasts until it dies.
    reader = subprocess.Popen(
        [sys.executable, "-c", _STALLED_READER, daemon.ipc_address, NAMESPACE, *(k.hex() for k in big)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdout is not None and reader.stdout.readline().strip() == "sent"
        with daemon.client() as probe:  # the reply is stuck in the daemon: the drain will wait for it
            wait_for(lambda: probe.stats()["server"]["inflight_bytes"] >= 32 * MiB, 20)
        with CacheClient(daemon.address, NAMESPACE, timeout_s=5.0, backoff_s=0.0, shared_memory=shared_memory) as c:
            assert c.uses_shared_memory == shared_memory
            assert daemon.proc is not None
            daemon.proc.send_signal(signal.SIGTERM)
            with CacheClient(daemon.address, NAMESPACE, timeout_s=5.0, fail_open=False) as strict:
                wait_for(lambda: _draining(strict), 10)
            daemon.proc.send_signal(signal.SIGTERM)  # a repeated stop signal changes nothing
            wait_for(lambda: "already stopping" in daemon.log(), 10)
            assert daemon.proc.poll() is None
            for _ in range(3):
                assert c.get(key) == [None]
                assert c.get_into(key, [bytearray(MiB)]) == [False]
                assert c.put([os.urandom(KEY_BYTES)], [os.urandom(MiB)]) == [PutStatus.FAILED]
                assert c.lookup(key).hit_chunks == 0
                assert c.exists(key) == [False]
            assert c.failures >= 5 and c.fail_open_stats["down"]
            with CacheClient(daemon.address, NAMESPACE, timeout_s=5.0, fail_open=False) as strict:
                with pytest.raises(Exception, match="SHUTTING_DOWN"):
                    strict.get(key)
    finally:
        reader.send_signal(signal.SIGKILL)
        reader.wait(10)
    assert daemon.stop() == 0


def _draining(client: CacheClient) -> bool:
    try:
        client.ping()
    except Exception as err:
        return "SHUTTING_DOWN" in str(err)
    return False
