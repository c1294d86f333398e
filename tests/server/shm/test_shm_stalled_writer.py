"""A shared-memory writer stalled past its lease can never change a committed chunk (issue #14.4).

A real writer process maps the pool, reserves a slot (alloc) and is stopped
with SIGSTOP before it copies: a stall longer than twice the lease timeout.
A pinned chunk fills the rest of the pool, so the daemon could give that
slot to another chunk only by reusing the stalled writer's memory.  While the
writer is stopped the slot must stay its own (another put gets no room);
when it resumes, writes into its slot and commits, the commit is refused and
only then is the memory reused; a chunk committed afterwards keeps its bytes.
A writer that dies instead frees its slot when its connection goes away.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from lmcache_client import PutStatus
from lmcache_client.protocol import KEY_BYTES

from ...conftest import NAMESPACE, Daemon, wait_for

MiB = 1 << 20
CHUNK = 30 * MiB  # a 64 MiB pool holds a pinned filler chunk and one of these

_STALLED_WRITER = """
import os, signal, sys
from lmcache_client import CacheClient, calls, shm
address, ns, key, size = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3]), int(sys.argv[4])
with CacheClient(address, ns, timeout_s=30, fail_open=False) as c:
    pool = c._shared_pool()
    grant = c._run(calls.alloc(ns, [key], [size], pool.segment, shm.owner()))  # as put_flow does
    offset, length = grant.loc[0]
    print("reserved", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # the stall: between alloc and the copy
    pool.view[offset : offset + length] = b"\\xee" * length  # resumes: copies into its slot
    try:
        c._run(calls.commit(grant.lease, pool.segment))
        print("committed", flush=True)
    except Exception as err:
        print("refused", type(err).__name__, err, flush=True)
"""


def start_writer(daemon: Daemon) -> subprocess.Popen[str]:
    with daemon.client() as c:  # the filler: never evicted, so only the writer's slot is left
        filler = [os.urandom(KEY_BYTES)]
        assert c.put(filler, [os.urandom(CHUNK)]) == [PutStatus.STORED] and c.pin(filler) == [True]
    writer = subprocess.Popen(
        [sys.executable, "-c", _STALLED_WRITER, daemon.address, NAMESPACE, os.urandom(KEY_BYTES).hex(), str(CHUNK)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None and writer.stdout.readline().strip() == "reserved"
    wait_for(lambda: _state(writer.pid) == "T", 10)
    return writer


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_stalled_writer_never_changes_a_committed_chunk(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory(max_local_cpu_size="64MiB", shm_lease_timeout_s=2, spill_ahead_size=0)
    writer = start_writer(daemon)
    key = [os.urandom(KEY_BYTES)]
    data = os.urandom(CHUNK)
    try:
        time.sleep(5)  # two and a half lease timeouts: its lease expired, and its quarantine too
        with daemon.client(fail_open=True) as c:
            assert c.uses_shared_memory
            # Its slot is still its own while it may write: no room for another chunk
            # (NO_SPACE, or BUSY -> FAILED: its bytes still count as reserved).
            assert c.put(key, [data]) in ([PutStatus.NO_SPACE], [PutStatus.FAILED])
            assert c.exists(key) == [False]
            writer.send_signal(signal.SIGCONT)
            assert writer.stdout is not None
            line = writer.stdout.readline()
            assert line.startswith("refused") and "UNKNOWN_LEASE" in line, line
            writer.wait(10)
            # Its commit came back: it is done writing, and the memory is free again.
            assert wait_for(lambda: c.put(key, [data]) == [PutStatus.STORED], 10)
            assert bytes(c.get(key)[0]) == data
            stats = c.stats()["shm"]
            assert stats["expired_writes"] == 1 and stats["quarantine_released"] == 1
            assert stats["quarantined_bytes"] == 0
    finally:
        writer.kill()
        writer.wait(10)


def test_a_writer_that_dies_frees_its_slot(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory(max_local_cpu_size="64MiB", shm_lease_timeout_s=2, spill_ahead_size=0)
    writer = start_writer(daemon)
    key = [os.urandom(KEY_BYTES)]
    data = os.urandom(CHUNK)
    with daemon.client(fail_open=True) as c:
        time.sleep(5)
        assert c.put(key, [data]) in ([PutStatus.NO_SPACE], [PutStatus.FAILED])
        writer.kill()  # a crash: its connection closes, nobody can write into the slot now
        writer.wait(10)
        assert wait_for(lambda: c.put(key, [data]) == [PutStatus.STORED], 10)
        assert bytes(c.get(key)[0]) == data


# -- the quarantine rules, on ShmLeases itself (the clock passed in) -------------------------
class _Store:
    """Records what the leases give back (the tiered store's ``abort``)."""

    def __init__(self) -> None:
        self.aborted: list[Any] = []

    def abort(self, reservation: Any) -> None:
        self.aborted.append(reservation)


def _owner_of(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])
    return {"pid": pid, "pidns": os.stat("/proc/self/ns/pid").st_ino, "start": start}


def test_quarantine_holds_while_the_writer_lives_and_frees_when_it_is_gone() -> None:
    from lmcache_server.server.shm import QUARANTINE_FACTOR, ShmLeases

    store = _Store()
    pool = SimpleNamespace(shared=True, shm_path=None, size=0, shm_token="t")
    leases = ShmLeases(store, pool, timeout_s=1.0)  # type: ignore[arg-type]
    now = time.monotonic()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    alive, _ = leases.grant_writes([SimpleNamespace(size=1)], _owner_of(os.getpid()))  # type: ignore[list-item]
    leases.grant_writes([SimpleNamespace(size=2)], _owner_of(child.pid))  # type: ignore[list-item]
    # Another pid namespace (its pid means nothing here), and an alloc naming no owner.
    leases.grant_writes([SimpleNamespace(size=4)], {"pid": 1, "pidns": 1, "start": 0})  # type: ignore[list-item]
    leases.grant_writes([SimpleNamespace(size=8)])  # type: ignore[list-item]
    assert leases.sweep(now + 2) == 4 and store.aborted == []
    assert leases.stats()["quarantined_bytes"] == 15
    child.kill()
    child.wait(10)
    leases.sweep(now + 3)
    assert [r.size for r in store.aborted] == [2]
    leases.sweep(now + 2 + QUARANTINE_FACTOR * 1.0 + 1)
    # Every quarantine is bounded (issue 29 item 3): the live writer's slot too.
    assert sorted(r.size for r in store.aborted) == [1, 2, 4, 8]
    stats = leases.stats()
    assert stats["quarantine_timed_out"] == 3 and stats["quarantine_released"] == 1
    assert stats["quarantined_bytes"] == 0
    assert leases.release([alive]) == [False] and len(store.aborted) == 4
