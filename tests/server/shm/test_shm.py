"""The same-host shared-memory data path, against real daemon processes.

The pool segment is a real file on /dev/shm (each daemon gets its own
directory there, see conftest), mapped by real client processes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_client import AsyncCacheClient, CacheClient, ErrorCode, PutStatus, ServerError, calls
from lmcache_client.tensors import tensor_bytes

from ...conftest import NAMESPACE, Daemon, wait_for

WORKER = Path(__file__).with_name("_shm_worker.py")
MiB = 1 << 20


def key(i: int, tag: str = "k") -> bytes:
    return hashlib.sha256(f"{tag}-{i}".encode()).digest()


def value(k: bytes, size: int) -> bytes:
    return hashlib.shake_128(k).digest(size)


def segments(daemon: Daemon) -> list[Path]:
    return sorted(daemon.shm_dir.glob("lmcache-pool-*"))


def shm_stats(c: CacheClient) -> dict[str, Any]:
    return dict(c.stats()["shm"])


def test_segment_is_owner_only_and_removed_at_stop(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory()
    (segment,) = segments(d)
    info = segment.stat()
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_uid == os.geteuid()
    assert info.st_size == 64 * MiB
    with d.client() as c:
        hello = c.hello()
        assert hello["shm"]["path"] == str(segment)
        assert hello["shm"]["size"] == 64 * MiB
    assert d.stop() == 0
    assert segments(d) == []


def test_group_access_makes_the_segment_group_readable(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory(shm_access="group")
    (segment,) = segments(d)
    assert stat.S_IMODE(segment.stat().st_mode) == 0o660
    assert "mode 660" in d.log()


def test_put_get_round_trip_over_shared_memory(daemon: Daemon) -> None:
    sizes = [1, 4095, 4096, 300_000, 3 * MiB + 7]
    keys = [key(i) for i in range(len(sizes))]
    values = [value(k, n) for k, n in zip(keys, sizes)]
    with daemon.client() as c:
        assert c.uses_shared_memory
        assert c.put(keys, values) == [PutStatus.STORED] * len(keys)
        assert c.put(keys[:2], values[:2]) == [PutStatus.EXISTS] * 2
        got = c.get([*keys, key(99)])
        assert [bytes(g) if g is not None else None for g in got] == [*values, None]
        out = [bytearray(n) for n in sizes]
        assert c.get_into(keys, out) == [True] * len(keys)
        assert [bytes(o) for o in out] == values
        s = shm_stats(c)
        # The large put went through a write lease, the gets through read leases.
        assert s["write_leases"] >= 1 and s["read_leases"] >= 2
        assert s["committed_bytes"] >= sum(sizes) - 4095 - 1
        assert wait_for(lambda: shm_stats(c)["active_read_leases"] == 0)
    # Another client, frames only, sees the same bytes.
    with daemon.client(shared_memory=False) as frames:
        assert not frames.uses_shared_memory
        assert [bytes(g) for g in frames.get(keys)] == values


def test_tensors_go_straight_into_and_out_of_the_pool(daemon: Daemon) -> None:
    src = [torch.randn(64, 1024, dtype=torch.float32) for _ in range(3)]
    keys = [key(i, "tensor") for i in range(3)]
    with daemon.client() as c:
        assert c.put_tensors(keys, src) == [PutStatus.STORED] * 3
        out = [torch.empty(64, 1024, dtype=torch.float32) for _ in range(3)]
        assert c.get_into(keys, out) == [True] * 3
        assert all(torch.equal(a, b) for a, b in zip(src, out))
        with pytest.raises(ValueError, match="bytes"):
            c.get_into(keys[:1], [torch.empty(10, dtype=torch.float32)])


def test_uncommitted_slot_is_invisible_until_commit(daemon: Daemon) -> None:
    k = key(1, "two-phase")
    data = value(k, MiB)
    with daemon.client() as writer, daemon.client() as reader:
        pool = writer._shared_pool()
        assert pool is not None
        grant = writer._run(calls.alloc(NAMESPACE, [k], [MiB], pool.segment))
        assert grant.status == [PutStatus.STORED] and grant.lease is not None
        offset, length = grant.loc[0]
        assert length == MiB
        pool.copy_in(offset, data)
        assert reader.exists([k]) == [False]
        assert reader.get([k]) == [None]
        assert reader.lookup([k]).hit_chunks == 0
        assert writer._run(calls.commit(grant.lease, pool.segment)) == [PutStatus.STORED]
        assert bytes(reader.get([k])[0]) == data
        # A second commit of the same lease is refused, and nothing changes.
        with pytest.raises(ServerError) as err:
            writer._run(calls.commit(grant.lease, pool.segment))
        assert err.value.code == ErrorCode.UNKNOWN_LEASE


def test_abandoned_write_lease_frees_its_slot(daemon: Daemon) -> None:
    with daemon.client() as c:
        pool = c._shared_pool()
        assert pool is not None
        before = c.stats()["tiers"]["memory"]["allocated_bytes"]
        grant = c._run(calls.alloc(NAMESPACE, [key(1, "abandon")], [2 * MiB], pool.segment))
        assert c.stats()["tiers"]["memory"]["allocated_bytes"] == before + 2 * MiB
        assert c._run(calls.release([grant.lease])) == [True]
        assert c.stats()["tiers"]["memory"]["allocated_bytes"] == before
        assert c.exists([key(1, "abandon")]) == [False]


def test_concurrent_readers_and_writers_in_several_processes(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory(max_local_cpu_size="48MiB")
    workers, n, size, rounds = 4, 12, 512 * 1024, 6
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "worker", d.ipc_address, NAMESPACE, str(w), str(n), str(size), str(rounds),
             str(workers)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(workers)
    ]  # fmt: skip
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, f"worker failed ({p.returncode}): {out} {err}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["wrong"] == 0 for r in results)
    assert sum(r["stored"] for r in results) == workers * n
    # 24 MiB of chunks in a 48 MiB pool: readers find what the others wrote.
    assert sum(r["hits"] for r in results) > 0
    with d.client() as c:
        s = shm_stats(c)
        assert s["write_leases"] >= workers and s["read_leases"] >= workers * rounds
        assert wait_for(lambda: shm_stats(c)["active_read_leases"] == 0)


def test_leases_of_a_killed_client_expire(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory(shm_lease_timeout_s=1.0)
    k = key(1, "held")
    with d.client() as c:
        c.put([k], [value(k, 2 * MiB)])
        holder = subprocess.Popen(
            [sys.executable, str(WORKER), "hold", d.ipc_address, NAMESPACE, k.hex()],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline().split() == ["held", "True", "True"]
            s = shm_stats(c)
            assert s["active_read_leases"] == 1 and s["active_write_leases"] == 1
            assert c.stats()["tiers"]["memory"]["leased_chunks"] == 1
            holder.send_signal(signal.SIGKILL)
            holder.wait(10)
        finally:
            holder.kill()
        assert wait_for(lambda: shm_stats(c)["active_read_leases"] == 0 and shm_stats(c)["active_write_leases"] == 0)
        s = shm_stats(c)
        assert s["expired_reads"] == 1 and s["expired_writes"] == 1
        assert c.stats()["tiers"]["memory"]["leased_chunks"] == 0
        # The expired write slot is quarantined until its writer is gone: it was killed.
        assert wait_for(lambda: shm_stats(c)["reserved_bytes"] == 0)
        assert c.stats()["tiers"]["memory"]["allocated_bytes"] == 2 * MiB
        assert bytes(c.get([k])[0]) == value(k, 2 * MiB)
        assert c.exists([hashlib.sha256(b"never committed").digest()]) == [False]
    body = _metrics(d)
    assert 'lmcache_shm_leases_expired_total{kind="read"} 1.0' in body
    assert 'lmcache_shm_leases_expired_total{kind="write"} 1.0' in body


def _metrics(d: Daemon) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def test_eviction_never_touches_a_leased_slot(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory(max_local_cpu_size="16MiB", cache_policy="lru")
    k = key(1, "leased")
    data = value(k, MiB)
    with d.client() as reader, d.client() as writer:
        reader.put([k], [data])
        pool = reader._shared_pool()
        assert pool is not None
        grant = reader._run(calls.get_shm(NAMESPACE, [k], pool.segment))
        offset, length = grant.loc[0]
        # A storm of 64 MiB through a 16 MiB pool: everything else is evicted.
        for i in range(64):
            kk = key(i, "storm")
            assert writer.put([kk], [value(kk, MiB)]) == [PutStatus.STORED]
        assert bytes(pool.view[offset : offset + length]) == data
        assert writer.exists([k]) == [True]
        assert writer.stats()["tiers"]["memory"]["evictions"] >= 48
        assert reader._run(calls.release([grant.lease])) == [True]
        # Released: now it is an ordinary LRU victim.
        for i in range(64, 96):
            kk = key(i, "storm")
            writer.put([kk], [value(kk, MiB)])
        assert writer.exists([k]) == [False]


def test_client_recovers_after_the_daemon_restarts(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory()
    keys = [key(i, "restart") for i in range(4)]
    values = [value(k, MiB) for k in keys]
    with d.client(address=d.ipc_address) as c:
        assert c.put(keys, values) == [PutStatus.STORED] * 4
        old = c._pool.path if c._pool else None
        assert old is not None
        d.kill()  # SIGKILL: its segment file stays behind
        assert Path(old).exists()
        d.start()
        # The stale segment of the dead daemon is gone, a new one is offered.
        assert not Path(old).exists()
        assert c.get(keys) == [None] * 4  # memory only: a restart loses the pool
        assert c.put(keys, values) == [PutStatus.STORED] * 4
        assert c._pool is not None and c._pool.path != old
        assert [bytes(g) for g in c.get(keys)] == values
        assert c.uses_shared_memory


def test_a_client_that_cannot_map_the_pool_uses_frames(daemon: Daemon) -> None:
    (segment,) = segments(daemon)
    keys = [key(i, "remote") for i in range(3)]
    values = [value(k, MiB) for k in keys]
    with daemon.client() as local:
        assert local.uses_shared_memory
        local.put(keys, values)
    # Another host (or container without the shared /dev/shm) cannot open the path.
    segment.unlink()
    with daemon.client() as remote:
        assert not remote.uses_shared_memory
        assert [bytes(g) for g in remote.get(keys)] == values
        k = key(9, "remote")
        assert remote.put([k], [value(k, MiB)]) == [PutStatus.STORED]
        assert shm_stats(remote)["write_leases"] == 1  # only the local client's


def test_daemon_without_shared_memory_serves_frames(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory(shared_memory=False)
    assert segments(d) == []
    with d.client() as c:
        assert c.hello()["shm"] is None
        assert not c.uses_shared_memory
        k = key(1, "noshm")
        assert c.put([k], [value(k, MiB)]) == [PutStatus.STORED]
        assert bytes(c.get([k])[0]) == value(k, MiB)
        with pytest.raises(ServerError) as err:
            c._run(calls.alloc(NAMESPACE, [k], [MiB], "whatever"))
        assert err.value.code == ErrorCode.STALE_SEGMENT


def test_bad_shared_memory_requests_get_clear_errors(daemon: Daemon) -> None:
    k = key(1, "bad")
    with daemon.client() as c:
        pool = c._shared_pool()
        assert pool is not None
        cases = [
            (calls.get_shm(NAMESPACE, [k], "0" * 32), ErrorCode.STALE_SEGMENT),
            (calls.alloc(NAMESPACE, [k], [MiB], "not-the-segment"), ErrorCode.STALE_SEGMENT),
            (calls.alloc(NAMESPACE, [k], [MiB, MiB], pool.segment), ErrorCode.BAD_REQUEST),
            (calls.alloc(NAMESPACE, [k], [0], pool.segment), ErrorCode.BAD_REQUEST),
            (calls.alloc(NAMESPACE, [k], [-5], pool.segment), ErrorCode.BAD_REQUEST),
            (calls.commit(12345, pool.segment), ErrorCode.UNKNOWN_LEASE),
            (calls.Call(calls.Op.COMMIT, lambda r, _: r, fields={"lease": "x", "shm": pool.segment}),
             ErrorCode.UNKNOWN_LEASE),
            (calls.Call(calls.Op.RELEASE, lambda r, _: r, fields={"leases": "x"}), ErrorCode.BAD_REQUEST),
        ]  # fmt: skip
        for call, code in cases:
            with pytest.raises(ServerError) as err:
                c._run(call)
            assert err.value.code == code, call
        assert c._run(calls.release([1, 2, "x"])) == [False, False, False]
        # A too-large slot is a status, not an error.
        grant = c._run(calls.alloc(NAMESPACE, [k], [1 << 40], pool.segment))
        assert grant.status == [PutStatus.TOO_LARGE] and grant.lease is None
        assert c.ping() > 0
        assert c.put([k], [value(k, MiB)]) == [PutStatus.STORED]


def test_async_client_uses_shared_memory(daemon: Daemon) -> None:
    keys = [key(i, "async") for i in range(4)]
    values = [value(k, 2 * MiB) for k in keys]

    async def run() -> None:
        async with AsyncCacheClient(daemon.address, NAMESPACE, fail_open=False) as c:
            assert await c.uses_shared_memory()
            assert await c.put(keys, values) == [PutStatus.STORED] * 4
            results = await asyncio.gather(*(c.get([k]) for k in keys))
            assert [bytes(r[0]) for r in results] == values
            out = [bytearray(2 * MiB) for _ in keys]
            assert await c.get_into(keys, out) == [True] * 4
            assert [bytes(o) for o in out] == values

    asyncio.run(run())
    with daemon.client() as c:
        assert shm_stats(c)["write_leases"] >= 1


def test_gpu_check_exits_cleanly_and_says_why(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    script = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_check.py"
    if torch.cuda.is_available():  # pragma: no cover - GPU hosts run the real check
        args = ["--sizes", "1", "--batch", "2", "--reps", "1"]
    else:
        args = []
    done = subprocess.run([sys.executable, str(script), *args, "--json", str(out)], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["available"] is torch.cuda.is_available()
    if not result["available"]:
        assert "CUDA" in result["reason"] and "nothing to measure" in done.stdout


@pytest.mark.parametrize("where", ["disk", "missing"])
def test_pool_stays_private_where_shm_dir_is_not_a_tmpfs(
    daemon_factory: Callable[..., Daemon], tmp_path: Path, where: str
) -> None:
    shm_dir = tmp_path / "on-disk" if where == "disk" else tmp_path / "nope"
    if where == "disk":
        shm_dir.mkdir()
    d = daemon_factory(shm_dir=str(shm_dir))
    assert "shared memory off" in d.log()
    assert not list(shm_dir.glob("*")) if shm_dir.exists() else True
    with d.client() as c:
        assert c.hello()["shm"] is None and not c.uses_shared_memory
        k = key(1, where)
        assert c.put([k], [value(k, MiB)]) == [PutStatus.STORED]
        assert bytes(c.get([k])[0]) == value(k, MiB)


@pytest.mark.parametrize("threads", [1, 3])
def test_large_copies_split_over_threads_keep_every_byte(daemon_factory: Callable[..., Daemon], threads: int) -> None:
    d = daemon_factory(max_local_cpu_size="96MiB")
    sizes = [4 * MiB, 5 * MiB + 123, 9 * MiB - 1]
    keys = [key(i, f"threads-{threads}") for i in range(len(sizes))]
    values = [value(k, n) for k, n in zip(keys, sizes)]
    # Sources of each kind: bytes, a writable buffer, a read-only view (copied without threads).
    sources: list[Any] = [values[0], bytearray(values[1]), memoryview(values[2])]
    with d.client(copy_threads=threads) as c:
        assert c.uses_shared_memory
        assert c.put(keys, sources) == [PutStatus.STORED] * 3
        out = [bytearray(n) for n in sizes]
        assert c.get_into(keys, out) == [True] * 3
        assert [bytes(o) for o in out] == values
        tensors = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        assert c.get_into(keys, tensors) == [True] * 3
        assert [bytes(tensor_bytes(t)) for t in tensors] == values
    with d.client(shared_memory=False) as frames:
        assert [bytes(g) for g in frames.get(keys)] == values
