"""The disk tier's write path through the real daemon: O_DIRECT files, spills lent
from the pool (no copy), chunks readable while queued, deletes of queued chunks."""

from __future__ import annotations

import os

import pytest

from lmcache_client import CacheClient, PutStatus
from lmcache_client.protocol import KEY_BYTES
from lmcache_server.storage.chunkfile import parse_header

from ...conftest import chunk_files, disk_stats, wait_for

MiB = 1 << 20
HEADER = 4096
# Sizes that end on a block boundary and sizes that do not (the last partial
# block takes another path under O_DIRECT).
SIZES = [MiB, MiB + 1, 3 * MiB // 2 + 100, 4096 * 7 + 5, MiB - 4095]


def drained(c: CacheClient) -> bool:
    return disk_stats(c)["queued_spills"] == 0


@pytest.fixture
def spill_daemon(disk_daemon):  # type: ignore[no-untyped-def]
    """conftest's disk_daemon with room for 256 MiB on disk."""

    def start(**config):  # type: ignore[no-untyped-def]
        config.setdefault("max_local_disk_size", "256MiB")
        return disk_daemon(**config)

    start.root = disk_daemon.root  # type: ignore[attr-defined]
    return start


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_files_hold_exact_records_and_read_back(spill_daemon, direct: bool) -> None:  # type: ignore[no-untyped-def]
    daemon = spill_daemon(disk_direct_io=direct)
    keys = [os.urandom(KEY_BYTES) for _ in range(30)]
    data = [os.urandom(SIZES[i % len(SIZES)]) for i in range(30)]
    with daemon.client() as c:
        assert disk_stats(c)["direct_io"] is direct
        for k, d in zip(keys, data):
            assert c.put([k], [d]) == [PutStatus.STORED]
        wait_for(lambda: drained(c) and disk_stats(c)["spills"] >= 20)
        assert disk_stats(c)["spills_dropped"] == 0
        # Every chunk reads back right, from whichever tier holds it (disk hits
        # are read straight into the pool and promoted).
        for k, d in zip(keys, data):
            [got] = c.get([k])
            assert got is not None and bytes(got) == d
        assert disk_stats(c)["hits"] >= 20 and disk_stats(c)["corrupt"] == 0
    # Each file is exactly one-block header + payload: no stray pool bytes past it.
    by_size = {len(d) for d in data}
    files = chunk_files(spill_daemon.root)
    assert len(files) >= 20
    for path in files:
        raw = path.read_bytes()
        header = parse_header(raw[:HEADER])
        assert header.header_len == HEADER and header.payload_len in by_size
        assert len(raw) == HEADER + header.payload_len
    # And they survive a restart, read the same way.
    assert daemon.stop() == 0
    daemon.start()
    with daemon.client() as c:
        assert disk_stats(c)["rebuilt_entries"] >= 20
        for k, d in zip(keys, data):
            [got] = c.get([k])
            assert got is not None and bytes(got) == d


@pytest.mark.parametrize("damage", ["flip-tail-byte", "truncate", "append-block", "append-byte"])
def test_damaged_odd_sized_file_is_a_miss(spill_daemon, damage: str) -> None:  # type: ignore[no-untyped-def]
    daemon = spill_daemon()
    keys = [os.urandom(KEY_BYTES) for _ in range(16)]
    data = [os.urandom(MiB + 777) for _ in keys]
    with daemon.client() as c:
        for k, d in zip(keys, data):
            c.put([k], [d])
        wait_for(lambda: drained(c) and disk_stats(c)["spills"] >= 8)
        on_disk = [(k, d) for k, d, t in zip(keys, data, c.lookup(keys).tiers) if t == "disk"]
    files = chunk_files(spill_daemon.root)
    assert len(files) == len(on_disk) > 0
    for path in files:
        raw = bytearray(path.read_bytes())
        if damage == "flip-tail-byte":
            raw[-3] ^= 0x10  # inside the last, partial block
        elif damage == "truncate":
            raw = raw[:-700]
        elif damage == "append-block":
            raw += bytes(4096)
        else:
            raw += b"x"
        path.write_bytes(bytes(raw))
    with daemon.client() as c:
        assert c.get([k for k, _ in on_disk]) == [None] * len(on_disk)
        assert disk_stats(c)["corrupt"] == len(on_disk)
        assert not any(p.exists() for p in files)


def test_put_storm_spills_lent_chunks_without_losing_or_mixing_bytes(spill_daemon) -> None:  # type: ignore[no-untyped-def]
    """Spill-ahead lends pool extents to the disk writers; an extent must not be
    reused (by the next put) before its write is done, or files would hold
    another chunk's bytes and fail their checksum."""
    daemon = spill_daemon(max_local_cpu_size="16MiB", spill_ahead_size="4MiB")
    keys = [os.urandom(KEY_BYTES) for _ in range(64)]
    data = [os.urandom(MiB) for _ in keys]
    with daemon.client() as c:
        for i in range(0, len(keys), 4):
            assert c.put(keys[i : i + 4], data[i : i + 4]) == [PutStatus.STORED] * 4
        wait_for(lambda: drained(c))
        stats = disk_stats(c)
        memory = c.stats()["tiers"]["memory"]
        assert stats["spills"] >= 48 and stats["spills_dropped"] == 0
        assert stats["spills_lent"] > 0  # some written straight from the pool
        # The memory tier kept room free ahead of the puts (an eighth of the pool here).
        assert memory["free_bytes"] >= 2 * MiB
        for k, d in zip(keys, data):
            [got] = c.get([k])
            assert got is not None and bytes(got) == d
        assert disk_stats(c)["corrupt"] == 0


def test_spill_ahead_off_lends_the_victims_a_put_waits_for(spill_daemon) -> None:  # type: ignore[no-untyped-def]
    """Without spill-ahead a put that needs room evicts then: its victims are lent
    to the disk (written from the pool; no 1 MiB copies on the event loop) and
    the put waits for those writes instead."""
    daemon = spill_daemon(spill_ahead_size=0)
    keys = [os.urandom(KEY_BYTES) for _ in range(24)]
    data = [os.urandom(MiB) for _ in keys]
    with daemon.client() as c:
        for k, d in zip(keys, data):
            assert c.put([k], [d]) == [PutStatus.STORED]
        wait_for(lambda: drained(c) and disk_stats(c)["spills"] >= 16)
        assert c.stats()["tiers"]["memory"]["allocated_bytes"] == 8 * MiB  # nothing kept free
        stats = disk_stats(c)
        assert stats["spills_lent"] == stats["spills"] and stats["spills_dropped"] == 0
        assert c.stats()["tiers"]["memory"]["rejections"] == 0
        for k, d in zip(keys, data):
            assert bytes(c.get([k])[0]) == d


def test_deleted_chunks_do_not_come_back_from_the_spill_queue(spill_daemon) -> None:  # type: ignore[no-untyped-def]
    """A chunk deleted while its spill is queued or being written is not on disk
    afterwards, not even after a restart."""
    daemon = spill_daemon(disk_fsync="data")  # slower writes: more deletes land while queued
    keys = [os.urandom(KEY_BYTES) for _ in range(40)]
    data = [os.urandom(MiB) for _ in keys]
    with daemon.client() as c:
        for k, d in zip(keys, data):
            c.put([k], [d])
        deleted = keys[:30]
        assert c.delete(deleted) == [True] * 30
        assert c.lookup(deleted).tiers == [None] * 30
        wait_for(lambda: drained(c))
        assert c.get(deleted) == [None] * 30
        kept = c.get(keys[30:])
        assert [bytes(g) for g in kept if g is not None] == [d for g, d in zip(kept, data[30:]) if g is not None]
    assert daemon.stop() == 0
    daemon.start()
    with daemon.client() as c:
        assert c.get(deleted) == [None] * 30
        assert c.lookup(deleted).hit_chunks == 0


def test_lent_chunks_are_always_given_back(spill_daemon) -> None:  # type: ignore[no-untyped-def]
    """Chunks promoted from disk and evicted again (nothing to write: already on
    disk), written, dropped or deleted: every lease taken for a spill ends."""
    daemon = spill_daemon(spill_ahead_size="2MiB")
    keys = [os.urandom(KEY_BYTES) for _ in range(24)]
    data = [os.urandom(MiB) for _ in keys]
    with daemon.client() as c:
        for rnd in range(3):
            for k, d in zip(keys, data):
                c.put([k], [d])
            wait_for(lambda: drained(c))
            for k, d in zip(keys, data):  # promotions, which evict (already on disk) chunks ahead
                assert bytes(c.get([k])[0]) == d
            c.delete(keys[rnd * 4 : rnd * 4 + 4])
            wait_for(lambda: drained(c))
        memory = c.stats()["tiers"]["memory"]
        assert memory["leased_chunks"] == 0
        assert memory["free_bytes"] + memory["allocated_bytes"] == memory["capacity_bytes"]
        # Room keeps coming back: the pool is not silted up with dead extents.
        assert memory["free_bytes"] >= MiB
        assert disk_stats(c)["spills_lent"] > 0


def test_stop_with_spills_in_flight_exits_cleanly(spill_daemon) -> None:  # type: ignore[no-untyped-def]
    """No drain time: writes from lent pool extents are still running when the
    daemon closes its tiers; it must wait for them, exit 0, and leave nothing
    that reads back wrong."""
    daemon = spill_daemon(drain_timeout_s=0, disk_fsync="data")
    keys = [os.urandom(KEY_BYTES) for _ in range(40)]
    data = [os.urandom(MiB + 4096 * (i % 3)) for i in range(40)]
    with daemon.client() as c:
        for i in range(0, 40, 8):
            c.put(keys[i : i + 8], data[i : i + 8])
    assert daemon.stop() == 0
    daemon.start()
    with daemon.client() as c:
        got = c.get(keys)
        assert all(g is None or bytes(g) == d for g, d in zip(got, data))
        assert disk_stats(c)["corrupt"] == 0
