"""One or two greedy clients cannot take the daemon from the others (issue #14 item 8).

Real client processes (tests/server/_greedy_client.py): readers that ask for big
replies and never read them, and a shared-memory writer that reserves room
and never commits.  The budgets are the defaults scaled down by 16: 64 MiB
in flight, 32 MiB per connection, 32 MiB messages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lmcache_client import PutStatus
from lmcache_client.protocol import KEY_BYTES

from ..conftest import NAMESPACE, Daemon, wait_for

MiB = 1 << 20
GREEDY = str(Path(__file__).with_name("_greedy_client.py"))
BUDGETS = {"max_inflight_bytes": "64MiB", "max_client_inflight_bytes": "32MiB", "max_message_size": "32MiB"}


@pytest.fixture
def greedy() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start greedy client processes; each is killed at teardown."""
    started: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, GREEDY, *args], stdout=subprocess.PIPE, text=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait(10)


def inflight(c: Any) -> int:
    return int(c.stats()["server"]["inflight_bytes"])


def test_two_readers_that_stop_reading_leave_the_rest_of_the_budget(
    daemon_factory: Callable[..., Daemon], greedy: Callable[..., subprocess.Popen[str]]
) -> None:
    daemon = daemon_factory(max_local_cpu_size="256MiB", **BUDGETS)
    keys = [os.urandom(KEY_BYTES) for _ in range(16)]
    data = [os.urandom(4 * MiB) for _ in keys]
    with daemon.client(shared_memory=False) as c:
        for i in range(0, 16, 4):
            assert c.put(keys[i : i + 4], data[i : i + 4]) == [PutStatus.STORED] * 4
        hexkeys = [k.hex() for k in keys[:8]]  # 32 MiB per get
        a = greedy("slow-reader", daemon.address, NAMESPACE, "1000", *hexkeys)
        assert a.stdout is not None and a.stdout.readline().strip() == "sent"
        wait_for(lambda: inflight(c) >= 32 * MiB)  # one of its replies is stuck; later gets get BUSY
        b = greedy("slow-reader", daemon.address, NAMESPACE, "1000", *hexkeys)
        assert b.stdout is not None and b.stdout.readline().strip() == "sent"
        wait_for(lambda: inflight(c) >= 40 * MiB)
        assert inflight(c) <= 48 * MiB  # the second one got half of what the first left, no more
        # Third clients are still served: fewer chunks per get while those two hold theirs.
        for _ in range(5):
            with daemon.client(shared_memory=False) as third:
                got = third.get(keys[8:])
            served = [(g, d) for g, d in zip(got, data[8:]) if g is not None]
            assert served and all(bytes(g) == d for g, d in served)
            assert third.failures == 0 and third.busy_replies == 0
            assert inflight(c) <= 56 * MiB  # theirs at most 48, plus this client's last reply
        with daemon.client(shared_memory=False) as third:
            assert third.put([os.urandom(KEY_BYTES)], [os.urandom(4 * MiB)]) == [PutStatus.STORED]
        wait_for(lambda: inflight(c) <= 48 * MiB)  # the third clients' bytes come back
    assert a.poll() is None and b.poll() is None  # still connected, still not reading
    assert 'lmcache_limit_violations_total{limit="fair_share"}' in _metrics(daemon)


def test_shared_memory_allocs_cannot_take_the_pool(
    daemon_factory: Callable[..., Daemon], greedy: Callable[..., subprocess.Popen[str]]
) -> None:
    daemon = daemon_factory(max_local_cpu_size="64MiB", shm_lease_timeout_s=60, **BUDGETS)
    keys = [os.urandom(KEY_BYTES) for _ in range(8)]
    with daemon.client(shared_memory=False) as c:
        for i in (0, 4):  # half the pool
            assert c.put(keys[i : i + 4], [os.urandom(4 * MiB) for _ in range(4)]) == [PutStatus.STORED] * 4
        hog = greedy("alloc-hog", daemon.address, NAMESPACE, str(4 * MiB), "16")  # asks for the whole pool
        assert hog.stdout is not None
        outcomes = json.loads(hog.stdout.readline())
        assert outcomes[:8] == ["ok"] * 8 and set(outcomes[8:]) == {"BUSY"}, outcomes
        assert c.stats()["shm"]["reserved_bytes"] == 32 * MiB  # a quarter of ... at most half the pool
        assert c.lookup(keys).hit_chunks == 8  # nothing of ours was evicted for it
        assert c.put([os.urandom(KEY_BYTES)], [os.urandom(4 * MiB)]) == [PutStatus.STORED]
    # A chunk larger than a message gets the put status TOO_LARGE, nothing reserved.
    big = greedy("alloc-hog", daemon.address, NAMESPACE, str(33 * MiB), "1")
    assert big.stdout is not None and json.loads(big.stdout.readline()) == [[int(PutStatus.TOO_LARGE)]]


def _metrics(daemon: Daemon) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=5) as r:
        return str(r.read().decode())
