"""The disk tier through the real daemon: spill, promotion, restart, damage, bounds, failures,
one daemon per spill directory."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from lmcache_client import PutStatus
from lmcache_client.protocol import KEY_BYTES

from ...conftest import Daemon, chunk_files, disk_stats, wait_for

MiB = 1 << 20


def keys_and_data(n: int, size: int = MiB) -> tuple[list[bytes], list[bytes]]:
    return [os.urandom(KEY_BYTES) for _ in range(n)], [os.urandom(size) for _ in range(n)]


def test_eviction_spills_to_disk_and_hits_promote(disk_daemon) -> None:  # type: ignore[no-untyped-def]
    daemon = disk_daemon()
    keys, data = keys_and_data(24)
    with daemon.client() as c:
        for k, d in zip(keys, data):
            assert c.put([k], [d]) == [PutStatus.STORED]
        wait_for(lambda: disk_stats(c)["spills"] >= 16)
        tiers = c.lookup(keys).tiers
        assert tiers[0] == "disk" and tiers[-1] == "memory"
        assert c.lookup(keys).hit_chunks == 24
        # A disk hit is served and promoted into memory.
        assert bytes(c.get(keys[:1])[0]) == data[0]
        assert c.lookup(keys[:1]).tiers == ["memory"]
        # Every chunk reads back right, from whichever tier holds it.
        assert [bytes(g) for g in c.get(keys)] == data
        stats = disk_stats(c)
        # A batch get leases its memory hits first, then promotes disk hits into the
        # room left (the rest are served from copies); it leases what it promotes
        # until sent, so the pool never holds more than its size.
        assert stats["hits"] >= 16 and stats["promotions"] >= 1
        assert c.stats()["tiers"]["memory"]["allocated_bytes"] <= 8 * MiB


def test_restart_keeps_disk_cache(disk_daemon) -> None:  # type: ignore[no-untyped-def]
    daemon = disk_daemon()
    keys, data = keys_and_data(20)
    with daemon.client() as c:
        for k, d in zip(keys, data):
            c.put([k], [d])
        wait_for(lambda: disk_stats(c)["spills"] >= 12)
        on_disk = [t == "disk" for t in c.lookup(keys).tiers]
    assert daemon.stop() == 0
    daemon.start()
    with daemon.client() as c:
        stats = disk_stats(c)
        assert stats["rebuilt_entries"] >= sum(on_disk)
        got = c.get(keys)
        for was_on_disk, g, d in zip(on_disk, got, data):
            if was_on_disk:
                assert g is not None and bytes(g) == d
            else:
                assert g is None or bytes(g) == d
    assert "index rebuilt" in daemon.log()


def _spill_some(daemon, n: int = 16):  # type: ignore[no-untyped-def]
    keys, data = keys_and_data(n)
    with daemon.client() as c:
        for k, d in zip(keys, data):
            c.put([k], [d])
        wait_for(lambda: disk_stats(c)["spills"] >= n - 8 and disk_stats(c)["queued_spills"] == 0)
        tiers = c.lookup(keys).tiers  # "disk" also names chunks queued for it: none left
    return [(k, d) for k, d, t in zip(keys, data, tiers) if t == "disk"]


@pytest.mark.parametrize("damage", ["flip-payload-byte", "flip-header-byte", "truncate", "append"])
def test_damaged_file_is_a_miss_never_wrong_bytes(disk_daemon, damage: str) -> None:  # type: ignore[no-untyped-def]
    daemon = disk_daemon()
    on_disk = _spill_some(daemon)
    files = chunk_files(disk_daemon.root)
    assert len(files) >= len(on_disk) > 0
    for path in files:
        raw = bytearray(path.read_bytes())
        if damage == "flip-payload-byte":
            raw[-1000] ^= 0x01
        elif damage == "flip-header-byte":
            raw[30] ^= 0x80
        elif damage == "truncate":
            raw = raw[: len(raw) - 10]
        else:
            raw += b"junk"
        path.write_bytes(bytes(raw))
    with daemon.client() as c:
        got = c.get([k for k, _ in on_disk])
        assert got == [None] * len(on_disk)
        stats = disk_stats(c)
        assert stats["corrupt"] == len(on_disk)
        # The damaged files are gone (promotion attempts may have spilled others),
        # and the daemon keeps serving.
        assert not any(p.exists() for p in files)
        k, d = keys_and_data(1)
        assert c.put(k, d) == [PutStatus.STORED]


def test_damaged_and_foreign_files_are_removed_at_start(disk_daemon) -> None:  # type: ignore[no-untyped-def]
    daemon = disk_daemon()
    on_disk = _spill_some(daemon)
    assert daemon.stop() == 0
    files = chunk_files(disk_daemon.root)
    # One truncated file, one foreign file, one record moved under another name, one stale temp file.
    files[0].write_bytes(files[0].read_bytes()[:5000])
    (files[1].parent / ("f" * 64 + ".chunk")).write_bytes(os.urandom(9000))
    os.rename(files[2], files[2].parent / ("e" * 64 + ".chunk"))
    (files[3].parent / ".tmp-123-456").write_bytes(b"partial")
    daemon.start()
    with daemon.client() as c:
        stats = disk_stats(c)
        assert stats["corrupt"] == 3
        assert stats["chunks"] == len(files) - 2  # the truncated and the moved one are gone
        got = c.get([k for k, _ in on_disk])
        for (_, d), g in zip(on_disk, got):
            assert g is None or bytes(g) == d
        assert sum(g is not None for g in got) == len(on_disk) - 2
    assert not list(disk_spill_tmp(disk_daemon.root))


def disk_spill_tmp(root: Path):  # type: ignore[no-untyped-def]
    return root.glob("v1/*/.tmp-*")


def test_disk_bound_holds_under_put_storm_and_matches_du(disk_daemon) -> None:  # type: ignore[no-untyped-def]
    daemon = disk_daemon(max_local_disk_size="12MiB")
    with daemon.client() as c:
        for _ in range(60):
            k, d = keys_and_data(1)
            c.put(k, d)
            assert disk_stats(c)["disk_bytes"] <= 12 * MiB
        wait_for(lambda: disk_stats(c)["queued_spills"] == 0)
        stats = disk_stats(c)
        assert stats["evictions"] > 0 and stats["disk_bytes"] <= 12 * MiB
        du = subprocess.run(["du", "-s", "-B1", str(disk_daemon.root / "v1")], capture_output=True, text=True)
        du_bytes = int(du.stdout.split()[0])
        dirs = len(list((disk_daemon.root / "v1").iterdir())) + 1
        files_only = du_bytes - dirs * 4096  # du counts the directories' own blocks too
        assert abs(files_only - stats["disk_bytes"]) <= 0.03 * stats["disk_bytes"]


def test_unusable_directory_degrades_to_memory_only(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the spill directory should be")
    daemon = daemon_factory(
        local_disk=f"file://{blocker}/spill", max_local_disk_size="64MiB", max_local_cpu_size="8MiB"
    )
    with daemon.client() as c:
        assert disk_stats(c)["degraded"] is True
        keys, data = keys_and_data(12)
        for k, d in zip(keys, data):
            assert c.put([k], [d]) == [PutStatus.STORED]
        assert bytes(c.get(keys[-1:])[0]) == data[-1]
    assert "disk tier degraded" in daemon.log()
    metrics = _metrics(daemon)
    assert 'lmcache_tier_degraded{tier="disk"} 1.0' in metrics


def _metrics(daemon) -> str:  # type: ignore[no-untyped-def]
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def test_full_disk_degrades_and_keeps_serving(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A file-size limit (prlimit) makes every chunk write fail the way a full disk does."""
    daemon = daemon_factory(
        prefix=["prlimit", f"--fsize={2 * MiB}"],  # bigger than the log, smaller than a chunk file
        local_disk=f"file://{tmp_path}/spill",
        max_local_disk_size="64MiB",
        max_local_cpu_size="8MiB",
    )
    with daemon.client() as c:
        keys, data = keys_and_data(10, 3 * MiB)
        for k, d in zip(keys, data):
            assert c.put([k], [d]) == [PutStatus.STORED]
        wait_for(lambda: disk_stats(c)["write_errors"] >= 1)
        stats = disk_stats(c)
        assert stats["degraded"] is True and stats["chunks"] == 0
        assert bytes(c.get(keys[-1:])[0]) == data[-1]
    assert "disk tier degraded" in daemon.log() and "disk full" in daemon.log()


# -- one daemon per spill directory (issue 29 item 13) ------------------------------------
def test_a_second_daemon_on_the_same_spill_directory_refuses_to_start(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    root = tmp_path / "spill"
    config = {"local_disk": f"file://{root}", "max_local_disk_size": "64MiB"}
    first = daemon_factory(**config)
    with pytest.raises(RuntimeError, match="exited with 2") as err:
        daemon_factory(**config)
    assert str(root) in str(err.value) and "another daemon" in str(err.value)
    # The first one still serves, its spill directory untouched.
    with first.client() as c:
        c.ping()
    assert first.stop() == 0
    # Once it stopped, the directory is free again.
    daemon_factory(**config).stop()
