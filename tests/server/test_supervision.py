"""Faults that used to end a background task or a request badly, against real daemons.

Real faults: a "Redis" that speaks RESP but answers nonsense, a spill directory
removed, made unwritable or with a chunk file replaced by a directory while
the daemon runs.  Bugs (which no input can produce) are planted by
tests/server/_fault_daemon.py.  In every case the daemon keeps serving, nothing
leaks, and what failed is logged and counted
(``lmcache_background_task_failures_total``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lmcache_client import PutStatus, ServerError
from lmcache_client.protocol import KEY_BYTES
from lmcache_server.supervisor import Supervisor

from ..conftest import Daemon, chunk_files, disk_stats, wait_for

MiB = 1 << 20
FAULT_DAEMON = str(Path(__file__).with_name("_fault_daemon.py"))


def metrics(daemon: Daemon) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def task_failures(daemon: Daemon, task: str) -> float:
    needle = f'lmcache_background_task_failures_total{{task="{task}"}} '
    line = next((x for x in metrics(daemon).splitlines() if x.startswith(needle)), None)
    return float(line.split()[-1]) if line else 0.0


def leased(c: Any) -> int:
    return int(c.stats()["tiers"]["memory"]["leased_chunks"])


# -- the supervisor itself -------------------------------------------------------------------
def test_supervisor_restarts_a_failing_loop_and_counts_each_failure(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> tuple[int, dict[str, int]]:
        supervisor = Supervisor(min_backoff_s=0.001, max_backoff_s=0.002)
        runs = [0]

        async def loop() -> None:
            runs[0] += 1
            if runs[0] <= 3:
                raise KeyError(f"run {runs[0]}")

        await asyncio.wait_for(supervisor.spawn("loop", loop), 10)
        forever = supervisor.spawn("forever", asyncio.Event().wait)
        await supervisor.close()
        assert forever.cancelled()
        return runs[0], supervisor.failures

    runs, failures = asyncio.run(scenario())
    assert runs == 4 and failures == {"loop": 3}
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 3 and all(r.exc_info for r in errors)  # each with its traceback
    assert "KeyError" in errors[0].getMessage()


# -- a "Redis" that answers nonsense -------------------------------------------------------------
HELLO_MAP = b"%3\r\n$6\r\nserver\r\n$5\r\nredis\r\n$7\r\nversion\r\n$5\r\n7.0.0\r\n$5\r\nproto\r\n:3\r\n"


class NonsenseRedis:
    """Speaks RESP on a free port: PING is PONG, SET and the handshake are OK, GET
    answers an integer and EXISTS a null (types no Redis would send)."""

    def __init__(self, garbled_hello: bool = False) -> None:
        self.garbled_hello = garbled_hello
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.url = f"redis://127.0.0.1:{self.sock.getsockname()[1]}"
        self.commands: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        try:
            while True:
                header = reader.readline()
                if not header.startswith(b"*"):
                    return
                args = []
                for _ in range(int(header[1:])):
                    size = int(reader.readline()[1:])
                    args.append(reader.read(size + 2)[:-2])
                name = args[0].upper()
                self.commands.append(name)
                # GET: an integer where a value (or null) belongs.  HELLO (redis-py >= 8.2 opens
                # with it): a RESP3 map, or with garbled_hello an OK where the map belongs.
                hello = b"+OK\r\n" if self.garbled_hello else HELLO_MAP
                reply = {b"PING": b"+PONG\r\n", b"GET": b":1\r\n", b"EXISTS": b"_\r\n", b"HELLO": hello}
                conn.sendall(reply.get(name, b"+OK\r\n"))
        except (OSError, ValueError):
            return
        finally:
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def nonsense_redis() -> Iterator[NonsenseRedis]:
    server = NonsenseRedis()
    yield server
    server.close()


def test_nonsense_from_redis_is_a_miss_and_leaks_no_lease(daemon_factory: Callable[..., Daemon],
                                                          nonsense_redis: NonsenseRedis) -> None:  # fmt: skip
    daemon = daemon_factory(remote_url=nonsense_redis.url, remote_timeout_s=0.5)
    hit, miss = os.urandom(KEY_BYTES), os.urandom(KEY_BYTES)
    with daemon.client(shared_memory=False) as c:
        assert c.stats()["tiers"]["redis"]["up"] is True
        assert c.put([hit], [b"h" * 100_000]) == [PutStatus.STORED]
        # The memory hit is leased for the reply; the miss asks "Redis", which answers an integer.
        got = c.get([hit, miss])
        assert got[0] is not None and bytes(got[0]) == b"h" * 100_000 and got[1] is None
        assert c.lookup([hit, miss]).hit_chunks == 1  # EXISTS answered null: a miss, not an error
        wait_for(lambda: leased(c) == 0)
        redis = c.stats()["tiers"]["redis"]
        assert redis["corrupt"] >= 1 and redis["read_errors"] >= 1
    assert b"GET" in nonsense_redis.commands and b"EXISTS" in nonsense_redis.commands
    assert daemon.proc is not None and daemon.proc.poll() is None
    assert "INTERNAL" not in metrics(daemon)


def test_a_garbled_redis_handshake_is_an_outage_not_a_crash(daemon_factory: Callable[..., Daemon]) -> None:
    """A server that answers redis-py's HELLO with OK (redis-py 8.2 raised AttributeError
    on it, and the daemon died at start): the uplink is down, the daemon serves."""
    server = NonsenseRedis(garbled_hello=True)
    try:
        daemon = daemon_factory(remote_url=server.url, remote_timeout_s=0.5)
        key = os.urandom(KEY_BYTES)
        with daemon.client(shared_memory=False) as c:
            assert c.put([key], [b"x" * 1000]) == [PutStatus.STORED]
            assert bytes(c.get([key])[0]) == b"x" * 1000
            assert c.get([os.urandom(KEY_BYTES)]) == [None]
        assert daemon.proc is not None and daemon.proc.poll() is None
        assert "INTERNAL" not in metrics(daemon)
    finally:
        server.close()


# -- the spill directory under the daemon's feet -----------------------------------------------------
def put_chunks(c: Any, n: int, fill: bytes) -> list[bytes]:
    keys = [os.urandom(KEY_BYTES) for _ in range(n)]
    for key in keys:
        assert c.put([key], [fill * MiB]) == [PutStatus.STORED]
    return keys


def test_spill_directory_removed_mid_run(disk_daemon: Any) -> None:
    daemon = disk_daemon(disk_retry_s=0.5)
    with daemon.client() as c:
        old = put_chunks(c, 16, b"a")
        wait_for(lambda: disk_stats(c)["spills"] >= 8)
        shutil.rmtree(disk_daemon.root)
        assert c.get(old[:4]) is not None  # misses where the files went, never an error
        # A spill that was writing when the directory went fails and degrades the tier
        # for disk_retry_s; later puts find it writing again (the directory comes back).
        spilled = disk_stats(c)["spills"]
        wait_for(lambda: put_chunks(c, 2, b"c") and disk_stats(c)["spills"] > spilled, 30)
        spilled = disk_stats(c)["spills"]
        new = put_chunks(c, 16, b"b")
        wait_for(lambda: disk_stats(c)["spills"] >= spilled + 8)  # the writers go on (the directory comes back)
        assert chunk_files(disk_daemon.root)
        first = new[0]
        wait_for(lambda: c.lookup([first]).tiers == ["disk"])
        assert bytes(c.get([first])[0]) == b"b" * MiB
    assert task_failures(daemon, "disk_writer") == 0


def _replace_with_a_file(directory: Path) -> bool:
    """Move ``directory`` aside and create a file in its place (False: a writer
    re-created it in between; try again)."""
    if directory.is_dir():
        directory.rename(directory.with_name(f"{directory.name}-{os.urandom(4).hex()}"))
    try:
        os.close(os.open(directory, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def test_spill_directory_unwritable_degrades_then_recovers(disk_daemon: Any) -> None:
    daemon = disk_daemon(disk_retry_s=0.5)
    shelf = disk_daemon.root / "v1"
    with daemon.client() as c:
        put_chunks(c, 12, b"a")
        wait_for(lambda: disk_stats(c)["spills"] >= 1)
        # Root can write anywhere: make the directory unusable by putting a file in its place.
        wait_for(lambda: _replace_with_a_file(shelf))
        put_chunks(c, 16, b"b")
        wait_for(lambda: disk_stats(c)["degraded"] is True)
        assert c.lookup([os.urandom(KEY_BYTES)]).hit_chunks == 0  # serving meanwhile
        shelf.unlink()
        spilled = disk_stats(c)["spills"]

        def recovered() -> bool:
            put_chunks(c, 1, b"c")  # the tier tries again with the first spill after disk_retry_s
            return disk_stats(c)["degraded"] is False and disk_stats(c)["spills"] > spilled

        wait_for(recovered)
    assert "disk tier degraded" in daemon.log() and "writable again" in daemon.log()


def test_chunk_file_replaced_by_a_directory(disk_daemon: Any) -> None:
    daemon = disk_daemon()
    with daemon.client() as c:
        keys = put_chunks(c, 16, b"a")
        wait_for(lambda: len(chunk_files(disk_daemon.root)) >= 8)
        wait_for(lambda: disk_stats(c)["queued_spills"] == 0)
        for path in chunk_files(disk_daemon.root):
            path.unlink()
            path.mkdir()
            (path / "inside").write_bytes(b"x")
        got = c.get(keys)  # every chunk that was only on disk is a miss now
        assert any(g is None for g in got) and all(g is None or bytes(g) == b"a" * MiB for g in got)
        wait_for(lambda: leased(c) == 0)
        spilled = disk_stats(c)["spills"]
        put_chunks(c, 16, b"b")
        wait_for(lambda: disk_stats(c)["spills"] >= spilled + 8)
    assert daemon.stop() == 0  # a clean stop: the index snapshot skips what is not a chunk


# -- planted bugs ---------------------------------------------------------------------------------
def fault_prefix(fault: str) -> list[str]:
    return [sys.executable, FAULT_DAEMON, fault]


def test_a_bug_in_dispatch_answers_internal_and_the_daemon_keeps_serving(
    daemon_factory: Callable[..., Daemon],
) -> None:
    daemon = daemon_factory(prefix=fault_prefix("dispatch-assert"))
    with daemon.client() as c:
        with pytest.raises(ServerError, match="INTERNAL"):
            c.put([os.urandom(KEY_BYTES)], [b"x" * 777])  # the planted accounting assert
        key = os.urandom(KEY_BYTES)
        assert c.put([key], [b"y" * 778]) == [PutStatus.STORED]
        assert bytes(c.get([key])[0]) == b"y" * 778
    assert task_failures(daemon, "dispatch") == 1
    assert "AssertionError: client ledger released more than it counted" in daemon.log()


def test_a_bug_in_a_disk_writer_restarts_it(disk_daemon: Any) -> None:
    daemon = disk_daemon(prefix=fault_prefix("disk-writer"), disk_io_threads=1)
    with daemon.client() as c:
        keys = put_chunks(c, 24, b"a")
        wait_for(lambda: disk_stats(c)["spills"] >= 8)  # the one writer failed twice and went on
        wait_for(lambda: c.lookup(keys[:1]).hit_chunks == 1 or disk_stats(c)["chunks"] >= 8)
    assert task_failures(daemon, "disk_writer") == 2
    assert daemon.log().count("disk_writer failed (RuntimeError: planted bug in spill write") == 2
