"""The disk tier's index snapshot through the real daemon: written at a clean
shutdown, used once at the next start, and never trusted when stale or damaged."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

import pytest

from lmcache_client import PutStatus
from lmcache_client.protocol import KEY_BYTES
from lmcache_server.storage.base import ChunkKey
from lmcache_server.storage.disk import DiskTier
from lmcache_server.storage.disk import files as diskfiles
from lmcache_server.storage.disk import snapshot as disksnapshot
from lmcache_server.storage.disk.files import path_for, write_record
from lmcache_server.storage.policy import make_policy

from ...conftest import disk_stats, wait_for

MiB = 1 << 20


@pytest.fixture
def filled(daemon_factory, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A stopped daemon whose disk tier holds some chunks, and what it holds."""
    root = tmp_path / "spill"
    daemon = daemon_factory(local_disk=f"file://{root}", max_local_cpu_size="8MiB", max_local_disk_size="128MiB")
    keys = [os.urandom(KEY_BYTES) for _ in range(24)]
    data = [os.urandom(MiB) for _ in keys]
    with daemon.client() as c:
        for k, d in zip(keys, data):
            assert c.put([k], [d]) == [PutStatus.STORED]
        wait_for(lambda: disk_stats(c)["spills"] >= 16 and disk_stats(c)["queued_spills"] == 0)
        on_disk = [(k, d) for k, d, t in zip(keys, data, c.lookup(keys).tiers) if t == "disk"]
    assert daemon.stop() == 0
    files = sorted(root.glob("v1/*/*.chunk"))
    assert len(files) >= len(on_disk) >= 16
    return daemon, root, on_disk, files


def snapshot(root: Path) -> Path:
    return root / "v1" / "index.snapshot"


def test_clean_restart_uses_the_snapshot_once(filled) -> None:  # type: ignore[no-untyped-def]
    daemon, root, on_disk, files = filled
    assert snapshot(root).is_file()
    daemon.start()
    with daemon.client() as c:
        stats = disk_stats(c)
        assert stats["rebuilt_from_snapshot"] == 1 and stats["rebuilt_entries"] == len(files)
        assert not snapshot(root).exists()  # used once: a crash now leaves none behind
        got = c.get([k for k, _ in on_disk])
        assert [bytes(g) for g in got if g is not None] == [d for (_, d), g in zip(on_disk, got) if g is not None]
        assert all(g is not None for g in got)
    assert "index rebuilt (from snapshot)" in daemon.log()
    # Killed: no snapshot, so the next start scans.
    assert daemon.stop(signal.SIGKILL) != 0
    assert not snapshot(root).exists()
    daemon.start()
    with daemon.client() as c:
        stats = disk_stats(c)
        assert stats["rebuilt_from_snapshot"] == 0 and stats["rebuilt_entries"] >= len(files)


@pytest.mark.parametrize("change", ["removed", "added", "renamed"])
def test_stale_snapshot_falls_back_to_the_scan(filled, change: str) -> None:  # type: ignore[no-untyped-def]
    daemon, root, on_disk, files = filled
    expected = len(files)
    if change == "removed":
        files[0].unlink()
        expected -= 1
    elif change == "added":  # a foreign file the scan removes
        (files[0].parent / ("f" * 64 + ".chunk")).write_bytes(os.urandom(9000))
    else:  # a record under another key's name: the scan removes it
        os.rename(files[0], files[0].parent / ("e" * 64 + ".chunk"))
        expected -= 1
    daemon.start()
    with daemon.client() as c:
        stats = disk_stats(c)
        assert stats["rebuilt_from_snapshot"] == 0
        assert stats["chunks"] == expected
        got = c.get([k for k, _ in on_disk])
        for (_, d), g in zip(on_disk, got):
            assert g is None or bytes(g) == d
    assert "index snapshot is stale" in daemon.log()


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_damaged_snapshot_falls_back_to_the_scan(filled, damage: str) -> None:  # type: ignore[no-untyped-def]
    daemon, root, on_disk, files = filled
    raw = bytearray(snapshot(root).read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0x01
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    else:
        raw = bytearray(os.urandom(len(raw)))
    snapshot(root).write_bytes(bytes(raw))
    daemon.start()
    with daemon.client() as c:
        stats = disk_stats(c)
        assert stats["rebuilt_from_snapshot"] == 0 and stats["chunks"] == len(files)
        got = c.get([k for k, _ in on_disk])
        assert [bytes(g) for g in got] == [d for _, d in on_disk]
    assert "is damaged; scanning" in daemon.log()


def test_file_damaged_in_place_under_a_valid_snapshot_is_a_miss(filled) -> None:  # type: ignore[no-untyped-def]
    """The snapshot only spares the start its header reads: every read still checks."""
    daemon, root, on_disk, files = filled
    for path in files:
        raw = bytearray(path.read_bytes())
        raw[-1000] ^= 0x01
        path.write_bytes(bytes(raw))
    daemon.start()
    with daemon.client() as c:
        assert disk_stats(c)["rebuilt_from_snapshot"] == 1
        assert c.get([k for k, _ in on_disk]) == [None] * len(on_disk)
        assert disk_stats(c)["corrupt"] == len(on_disk)


def _tier_keys(root: Path) -> list[tuple[ChunkKey, int]]:
    async def run() -> list[tuple[ChunkKey, int]]:
        tier = DiskTier(root, 1 << 40, policy=make_policy("lfuda"))
        await tier.open()
        try:
            assert tier.counters.rebuilt_from_snapshot == 1
            return [(k, tier.index.entries[k].payload_len) for k in tier.policy.order()]
        finally:
            tier.lifecycle.opened = False  # no snapshot written at close
            await tier.close()

    return asyncio.run(run())


def _files(root: Path, n: int) -> list[tuple[ChunkKey, int]]:
    entries = [(ChunkKey("ns|a" if i % 3 else "ns|b", os.urandom(32)), 100 + i % 2) for i in range(n)]
    for key, size in entries:
        write_record(path_for(root, key), key, os.urandom(size), "none")
    return entries


def test_snapshot_formats_load_in_their_order(tmp_path: Path) -> None:
    """Format 2 (columns) and the old format 1 (msgpack rows) give the same index,
    oldest first; a format this daemon does not know is ignored (the scan rebuilds)."""
    entries = _files(tmp_path, 40)
    disksnapshot.save(tmp_path, entries)
    assert _tier_keys(tmp_path) == entries
    assert not snapshot(tmp_path).exists()  # used once
    disksnapshot._write(tmp_path, disksnapshot._body_v1(entries), 1, len(entries))
    assert _tier_keys(tmp_path) == entries
    disksnapshot.save(tmp_path, entries)
    raw = bytearray(snapshot(tmp_path).read_bytes())
    raw[4] = 9  # the version field
    snapshot(tmp_path).write_bytes(bytes(raw))
    assert disksnapshot.load(tmp_path) is None and not snapshot(tmp_path).exists()


def test_snapshot_trusts_only_directories_unchanged_since_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Format 2 compares the fan-out directories' times instead of listing every
    file: a directory changed since is stale; one not older than the snapshot's
    clock (racy: here, times in the future) is listed and compared name by name."""
    entries = _files(tmp_path, 30)
    base = tmp_path / "v1"
    subs = [d for d in base.iterdir() if d.is_dir()]
    disksnapshot.save(tmp_path, entries)  # just written: the save waits for the clock to pass them
    decoded = disksnapshot._decode(snapshot(tmp_path).read_bytes())
    assert decoded is not None and decoded.dirs is not None
    taken, recorded = decoded.dirs
    assert all(mtime < taken for mtime in recorded.values())
    assert decoded.matches(base)
    mtime = subs[0].stat().st_mtime_ns
    os.utime(subs[0], ns=(mtime + 1, mtime + 1))  # touched since: stale
    assert not decoded.matches(base)
    os.utime(subs[0], ns=(mtime, mtime))
    assert decoded.matches(base)
    # Racy: directories whose times the clock had not passed when it was saved are listed.
    monkeypatch.setattr(disksnapshot, "SAVE_WAIT_S", 0.05)
    future = time.time_ns() + 3600 * 10**9
    for d in subs:
        os.utime(d, ns=(future, future))
    disksnapshot.save(tmp_path, entries)
    decoded = disksnapshot._decode(snapshot(tmp_path).read_bytes())
    assert decoded is not None and decoded.matches(base)
    victim = next(iter(subs[0].glob("*.chunk")))
    victim.rename(victim.with_name("e" * 64 + ".chunk"))
    os.utime(subs[0], ns=(future, future))  # the time recorded: only the listing sees the rename
    assert not decoded.matches(base)
    assert not list(base.glob(".tmp-*"))  # no probe left behind


def test_a_scan_logs_its_progress(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A crash scan of a large directory takes minutes: every ``progress_s`` it logs how far it
    is (what a startup probe's operator watches); a quick scan logs nothing."""
    entries = _files(tmp_path, 200)
    directories = len(list((tmp_path / "v1").iterdir()))
    caplog.set_level(logging.INFO, logger="lmcache_server.storage.disk.files")
    found, removed = diskfiles.scan(tmp_path, threads=2)
    assert removed == 0 and sorted(e[1] for e in found) == sorted(k for k, _ in entries)
    assert not [r for r in caplog.records if "rebuilding the index" in r.getMessage()]
    found, _ = diskfiles.scan(tmp_path, threads=2, progress_s=0.0)
    lines = [r.getMessage() for r in caplog.records if "rebuilding the index" in r.getMessage()]
    assert len(lines) == directories - 1  # each directory but the last; the end is the tier's own line
    assert f"{directories - 1} of {directories} directories" in lines[-1]
    assert len(found) == len(entries)
