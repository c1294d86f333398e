"""Lifecycle: graceful shutdown, restarts under a connected client, fail-open clients."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from lmcache_client import AsyncCacheClient, CacheClient, DaemonUnavailable, ErrorCode, PutStatus, ServerError
from lmcache_client.protocol import KEY_BYTES

from ..conftest import NAMESPACE, Daemon, free_port, wait_for


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly_with_exit_0(daemon: Daemon, sig: int) -> None:
    with daemon.client() as c:
        c.put([os.urandom(KEY_BYTES)], [b"x" * 100_000])
    assert daemon.stop(sig) == 0
    log = daemon.log()
    assert "lmcache-server ready" in log and "drained cleanly" in log and "lmcache-server stopped" in log


def test_repeated_signals_during_shutdown_still_exit_0(daemon: Daemon) -> None:
    """A supervisor that repeats SIGTERM while the daemon shuts down must not kill it mid-cleanup."""
    with daemon.client() as c:
        c.put([os.urandom(KEY_BYTES)], [b"x" * 100_000])
    assert daemon.proc is not None
    sent = 0
    while daemon.proc.poll() is None and sent < 50_000:  # every phase: drain, flush, snapshots, teardown
        daemon.proc.send_signal(signal.SIGTERM)
        sent += 1
        time.sleep(0.0002)  # dense enough to land in a microsecond-wide gap now and then
    assert sent > 1
    assert daemon.stop() == 0
    assert "lmcache-server stopped" in daemon.log()


def test_startup_logs_one_config_line(daemon: Daemon) -> None:
    lines = [line for line in daemon.log().splitlines() if "lmcache-server ready" in line]
    assert len(lines) == 1
    assert daemon.address in lines[0] and "memory=0.06GiB" in lines[0] and "policy=adaptive" in lines[0]


def test_requests_in_flight_during_shutdown_all_get_replies(daemon: Daemon) -> None:
    """Clients hammering the daemon while it stops: every request it received is
    answered (a reply, or SHUTTING_DOWN once it drains), never wrong data, and
    the drain ends with nothing left in flight.  Strict clients (fail_open off),
    so a missing reply cannot pass for a miss: a request without a reply
    (DaemonUnavailable) may only be one sent after the daemon closed its socket,
    and so only each client's last."""
    payload = os.urandom(256 * 1024)
    outcomes: list[list[str]] = [[] for _ in range(3)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def hammer(log: list[str]) -> None:
        with daemon.client(timeout_s=3.0, fail_open=False) as c:
            while not stop.is_set():
                key = [os.urandom(KEY_BYTES)]
                try:
                    if c.put(key, [payload]) != [PutStatus.STORED]:
                        log.append("not stored")
                        continue
                    got = c.get(key)[0]  # stored and answered: it must be there, byte for byte
                    log.append("ok" if got is not None and bytes(got) == payload else "WRONG")
                except ServerError as err:
                    log.append(err.code.name if isinstance(err.code, ErrorCode) else str(err.code))
                except DaemonUnavailable:
                    log.append("unavailable")
                    return  # the daemon is gone: nothing more can be answered
                except BaseException as err:  # noqa: BLE001 - collected and re-raised below
                    errors.append(err)
                    return

    threads = [threading.Thread(target=hammer, args=(log,)) for log in outcomes]
    for t in threads:
        t.start()
    wait_for(lambda: all(log.count("ok") >= 3 for log in outcomes) or errors)
    assert daemon.stop(signal.SIGTERM) == 0
    stop.set()
    for t in threads:
        t.join(15)
    assert not errors, errors
    for log in outcomes:
        assert set(log) <= {"ok", "SHUTTING_DOWN", "unavailable"}, log
        assert "unavailable" not in log[:-1], log  # no reply missing while it was still serving
    assert "drained cleanly" in daemon.log()  # nothing in flight was cut off


def test_client_survives_daemon_restart(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory()
    key = [os.urandom(KEY_BYTES)]
    with CacheClient(daemon.address, NAMESPACE, timeout_s=0.5) as c:
        assert c.put(key, [b"before"]) == [PutStatus.STORED]
        daemon.stop()
        # Down: data ops answer like misses, fast, and are counted; admin ops raise.
        started = time.monotonic()
        assert c.get(key) == [None]
        assert c.lookup(key).hit_chunks == 0
        assert c.put(key, [b"x"]) == [PutStatus.FAILED]
        assert c.exists(key) == [False]
        # One timeout opened the breaker; the other three were answered without a request.
        assert c.failures == 1 and c.short_circuited == 3
        assert time.monotonic() - started < 0.5 + 10
        with pytest.raises(DaemonUnavailable):
            c.stats()
        # Same port, new process: the same client object recovers by itself.
        daemon.start()
        deadline = time.monotonic() + 10
        while c.put(key, [b"after"]) != [PutStatus.STORED]:
            assert time.monotonic() < deadline, "client never reconnected"
            time.sleep(0.1)
        assert bytes(c.get(key)[0]) == b"after"


def test_async_client_fails_open_and_recovers(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory()

    async def main() -> None:
        async with AsyncCacheClient(daemon.address, NAMESPACE, timeout_s=0.5) as c:
            key = [os.urandom(KEY_BYTES)]
            assert await c.put(key, [b"v1"]) == [PutStatus.STORED]
            daemon.stop()
            assert await c.get(key) == [None]
            assert (await c.lookup(key)).hit_chunks == 0
            with pytest.raises(DaemonUnavailable):
                await c.ping()
            daemon.start()
            deadline = time.monotonic() + 10
            while await c.put(key, [b"v2"]) != [PutStatus.STORED]:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            assert bytes((await c.get(key))[0]) == b"v2"

    asyncio.run(main())


def test_unreachable_daemon_costs_one_timeout_per_outage() -> None:
    """Not one timeout per request: the first failure opens the breaker and the
    next data ops are answered as misses without a request (no wall clock asserted)."""
    with CacheClient(f"tcp://127.0.0.1:{free_port()}", NAMESPACE, timeout_s=0.3) as c:
        key = [os.urandom(KEY_BYTES)]
        assert c.get(key) == [None]
        assert (c.failures, c.short_circuited) == (1, 0)  # one request, timed out
        assert c.get(key) == [None] and c.lookup(key).hit_chunks == 0
        assert (c.failures, c.short_circuited) == (1, 2)  # answered without sending anything
    with CacheClient(f"tcp://127.0.0.1:{free_port()}", NAMESPACE, timeout_s=0.3, fail_open=False) as c:
        with pytest.raises(DaemonUnavailable, match="0.3s|no connection"):
            c.get([os.urandom(KEY_BYTES)])
