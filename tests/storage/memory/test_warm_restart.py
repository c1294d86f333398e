"""Warm restarts (storage/memory/warmstart.py), against real daemon processes.

A clean stop leaves the pool segment and its index on the tmpfs; the next
daemon with the same listen addresses and pool size adopts them and serves
hits from memory at once.  Everything else (another pool size, a damaged or
foreign index, a crash) is a cold start with one log line, and the old segment
goes.  Bytes are compared by SHA-256 against what was put.
"""

from __future__ import annotations

import hashlib
import os
import signal
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from lmcache_client import CacheClient, ErrorCode, PutStatus, ServerError, calls
from lmcache_client.shm import owner
from lmcache_server.storage.base import ChunkKey
from lmcache_server.storage.memory.warmstart import (
    HeldLease,
    HeldSlot,
    WarmIndex,
    WarmIndexError,
    check,
    decode,
    encode,
)

from ...conftest import NAMESPACE, Daemon, wait_for

MiB = 1 << 20
REFUSED = "warm restart refused"


def key(i: int, tag: str = "w") -> bytes:
    return hashlib.sha256(f"{tag}-{i}".encode()).digest()


def value(k: bytes, size: int = MiB) -> bytes:
    return hashlib.shake_128(k).digest(size)


def sha(data: object) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()  # type: ignore[call-overload]


def segment_of(d: Daemon) -> Path:
    (segment,) = [p for p in d.shm_dir.iterdir() if p.name.startswith("lmcache-pool-") and "." not in p.name]
    return segment


def index_of(segment: Path) -> Path:
    return segment.with_name(segment.name + ".warm")


def memory_stats(c: CacheClient) -> dict[str, object]:
    return dict(c.stats()["tiers"]["memory"])


def warm_daemon(factory: Callable[..., Daemon], **config: object) -> Daemon:
    return factory(warm_restart=True, **config)


def put_all(d: Daemon, keys: list[bytes], **client: object) -> dict[bytes, str]:
    with d.client(**client) as c:
        assert c.put(keys, [value(k) for k in keys]) == [PutStatus.STORED] * len(keys)
    return {k: sha(value(k)) for k in keys}


def test_clean_restart_adopts_the_pool(daemon_factory: Callable[..., Daemon]) -> None:
    d = warm_daemon(daemon_factory, cache_policy="lru")
    framed = [key(i, "frames") for i in range(4)]
    shared = [key(i, "shm") for i in range(8)]
    sums = put_all(d, framed, shared_memory=False) | put_all(d, shared)
    with d.client() as c:
        assert c.uses_shared_memory
        assert c.pin([shared[1]]) == [True]
        c.get([framed[0]])  # the most recent: the last LRU victim
    segment = segment_of(d)
    assert d.stop() == 0
    assert segment.exists() and index_of(segment).exists()
    assert "kept the memory pool for a warm restart: 12 chunks" in d.log()
    d.start()
    assert "warm restart: adopted " + segment.name in d.log()
    assert not index_of(segment).exists()  # the clean marker is gone the moment it is adopted
    assert segment_of(d) == segment
    with d.client() as c:
        everything = framed + shared
        assert c.lookup(everything).tiers == ["memory"] * 12
        assert [sha(g) for g in c.get(everything)] == [sums[k] for k in everything]
        stats = memory_stats(c)
        assert stats["adopted"] == 12 and stats["hits"] == 12 and stats["misses"] == 0
        assert stats["pinned_bytes"] == MiB
        # The LRU order survived: new chunks push out the oldest first, never the pinned one.
        for i in range(54):
            k = key(i, "new")
            assert c.put([k], [value(k)]) == [PutStatus.STORED]
        assert c.exists([framed[1], shared[1]]) == [False, True]


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "tcp"])
def test_a_client_keeps_working_across_a_warm_restart(
    daemon_factory: Callable[..., Daemon], shared_memory: bool
) -> None:
    d = warm_daemon(daemon_factory)
    keys = [key(i, f"across-{shared_memory}") for i in range(6)]
    with CacheClient(d.address, NAMESPACE, timeout_s=2.0, backoff_s=0.0, shared_memory=shared_memory) as c:
        assert c.put(keys, [value(k) for k in keys]) == [PutStatus.STORED] * 6
        mapped = c._pool.path if c._pool else None
        assert c.uses_shared_memory == shared_memory
        assert d.stop() == 0
        d.start()
        got = wait_for(lambda: (g := c.get(keys)) and all(x is not None for x in g) and g)
        assert [sha(g) for g in got] == [sha(value(k)) for k in keys]
        assert c.failures <= 1
        if shared_memory:  # the same segment: the mapping is kept
            assert c.uses_shared_memory and c._pool is not None and c._pool.path == mapped
        k = key(99, "after")
        assert c.put([k], [value(k)]) == [PutStatus.STORED]
        assert sha(c.get([k])[0]) == sha(value(k))


def test_another_pool_size_starts_cold_and_removes_the_segment(daemon_factory: Callable[..., Daemon]) -> None:
    d = warm_daemon(daemon_factory)
    keys = [key(i, "resize") for i in range(4)]
    put_all(d, keys)
    old = segment_of(d)
    assert d.stop() == 0
    d.config["max_local_cpu_size"] = "32MiB"
    d.start()
    refused = [line for line in d.log().splitlines() if REFUSED in line]
    assert len(refused) == 1
    assert "pool size changed (64 MiB in the index, 32 MiB configured)" in refused[0]
    assert "removed the old pool segment" in refused[0]
    assert not old.exists() and not index_of(old).exists()
    assert segment_of(d) != old
    with d.client() as c:
        assert c.get(keys) == [None] * 4
        assert memory_stats(c)["capacity_bytes"] == 32 * MiB


def _flip_body(raw: bytes) -> bytes:
    return raw[:-1] + bytes([raw[-1] ^ 0x40])


def _version_99(raw: bytes) -> bytes:
    return raw[:8] + struct.pack("<I", 99) + raw[12:]


DAMAGE = {
    "flipped-byte": (_flip_body, "checksum mismatch"),
    "truncated": (lambda raw: raw[: len(raw) // 2], "truncated"),
    "other-version": (_version_99, "index format version 99, this daemon reads version 2"),
    "garbage": (lambda raw: b"\x00garbage" * 20, "bad magic"),
    "empty": (lambda raw: b"", "truncated"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_index_is_a_cold_start_with_one_clear_line(
    daemon_factory: Callable[..., Daemon], damage: str
) -> None:
    d = warm_daemon(daemon_factory)
    keys = [key(i, "damaged") for i in range(4)]
    put_all(d, keys)
    old = segment_of(d)
    assert d.stop() == 0
    change, reason = DAMAGE[damage]
    index_of(old).write_bytes(change(index_of(old).read_bytes()))
    d.start()
    refused = [line for line in d.log().splitlines() if REFUSED in line]
    assert len(refused) == 1 and reason in refused[0], refused
    assert not old.exists() and not index_of(old).exists()
    with d.client() as c:  # nothing adopted, and a working cache
        assert c.get(keys) == [None] * 4
        assert c.put(keys, [value(k) for k in keys]) == [PutStatus.STORED] * 4
        assert [sha(g) for g in c.get(keys)] == [sha(value(k)) for k in keys]


def test_a_crash_never_adopts(daemon_factory: Callable[..., Daemon]) -> None:
    d = warm_daemon(daemon_factory)
    keys = [key(i, "crash") for i in range(4)]
    put_all(d, keys)
    # Killed: no index, so the next start is cold and removes the dead segment.
    old = segment_of(d)
    assert d.stop(signal.SIGKILL) != 0
    assert not index_of(old).exists()
    d.start()
    assert "adopted" not in d.log() and not old.exists()
    with d.client() as c:
        assert c.get(keys) == [None] * 4
    # Adopted after a clean stop, then killed: adopting used up the marker, so cold again.
    sums = put_all(d, keys)
    assert d.stop() == 0
    d.start()
    with d.client() as c:
        assert [sha(g) for g in c.get(keys)] == [sums[k] for k in keys]
    adopted = segment_of(d)
    assert d.stop(signal.SIGKILL) != 0
    assert not index_of(adopted).exists()
    d.start()
    assert d.log().count("warm restart: adopted") == 1 and not adopted.exists()
    with d.client() as c:
        assert c.get(keys) == [None] * 4


def test_a_write_slot_in_flight_at_the_stop_is_never_reused(daemon_factory: Callable[..., Daemon]) -> None:
    d = warm_daemon(daemon_factory, cache_policy="lru")
    slot_key = key(0, "in-flight")
    with d.client() as writer:
        pool = writer._shared_pool()
        assert pool is not None
        grant = writer._run(calls.alloc(NAMESPACE, [slot_key], [2 * MiB], pool.segment, owner()))
        offset, length = grant.loc[0]
        assert d.stop() == 0  # the writer has not committed: its copy may still be under way
        d.start()
        shm = dict(writer.stats()["shm"])
        assert shm["quarantined_bytes"] == 2 * MiB and shm["reserved_bytes"] == 2 * MiB
        # Three pools' worth of puts recycle every other byte; the late writer keeps copying.
        stored: list[bytes] = []
        for i in range(3 * 64):
            k = key(i, "storm")
            assert writer.put([k], [value(k)]) == [PutStatus.STORED]
            stored.append(k)
            pool.copy_in(offset, b"\xee" * length)
        held = [k for k in stored if writer.exists([k]) == [True]]
        assert len(held) >= 50
        assert [sha(g) for g in writer.get(held)] == [sha(value(k)) for k in held]
        # Its late commit is refused (the write is aborted) and frees the slot.
        with pytest.raises(ServerError) as err:
            writer._run(calls.commit(grant.lease, pool.segment))
        assert err.value.code == ErrorCode.UNKNOWN_LEASE
        assert writer.exists([slot_key]) == [False]
        shm = dict(writer.stats()["shm"])
        assert shm["quarantined_bytes"] == 0 and shm["quarantine_released"] == 1


def test_a_read_lease_held_at_the_stop_keeps_its_chunk(daemon_factory: Callable[..., Daemon]) -> None:
    d = warm_daemon(daemon_factory, cache_policy="lru")
    k = key(0, "reading")
    with d.client() as reader:
        assert reader.put([k], [value(k)]) == [PutStatus.STORED]
        pool = reader._shared_pool()
        assert pool is not None
        grant = reader._run(calls.get_shm(NAMESPACE, [k], pool.segment))
        offset, length = grant.loc[0]
        assert d.stop() == 0
        d.start()
        assert dict(reader.stats()["shm"])["active_read_leases"] == 1
        for i in range(2 * 64):  # everything else is evicted, the leased chunk stays and keeps its bytes
            kk = key(i, "storm")
            assert reader.put([kk], [value(kk)]) == [PutStatus.STORED]
        assert sha(pool.view[offset : offset + length]) == sha(value(k))
        assert reader._run(calls.release([grant.lease])) == [True]
        assert memory_stats(reader)["leased_chunks"] == 0


# -- one extent, two read slots (issue 29 item 1) --------------------------------------
def named(tag: str) -> bytes:
    """A key named by its tag alone (the two-slot test's keys)."""
    return hashlib.sha256(tag.encode()).digest()


@pytest.mark.parametrize("twice", ["two-leases", "one-get-naming-it-twice"])
def test_an_extent_held_by_two_read_slots_is_freed_once_after_a_warm_restart(
    daemon_factory: Callable[..., Daemon], twice: str
) -> None:
    d = daemon_factory(warm_restart=True, cache_policy="lru")
    k, m, n = named("K"), named("M"), named("N")
    with d.client() as c:
        assert c.put([k], [value(k)]) == [PutStatus.STORED]
        pool = c._shared_pool()
        assert pool is not None
        if twice == "two-leases":
            first = c._run(calls.get_shm(NAMESPACE, [k], pool.segment))
            second = c._run(calls.get_shm(NAMESPACE, [k], pool.segment))
            leases = [first.lease, second.lease]
            offset = first.loc[0][0]
        else:
            grant = c._run(calls.get_shm(NAMESPACE, [k, k], pool.segment))
            assert grant.loc[0] == grant.loc[1]
            leases = [grant.lease]
            offset = grant.loc[0][0]
        assert c._run(calls.delete(NAMESPACE, [k])) == [True]
        assert d.stop() == 0
        d.start()
        assert "warm restart: adopted" in d.log()
        if twice == "two-leases":
            assert c._run(calls.release([leases[0]])) == [True]
        assert c.put([m], [value(m)]) == [PutStatus.STORED]
        where = c._run(calls.get_shm(NAMESPACE, [m], pool.segment))
        assert c._run(calls.release([where.lease])) == [True]
        assert where.loc[0][0] != offset  # K's extent is still held by the other slot
        assert c._run(calls.release(leases[-1:])) == [True]
        # N (and a few more) take whatever room is free: never M's extent.
        more = [n] + [named(f"N{i}") for i in range(6)]
        for x in more:
            assert c.put([x], [value(x)]) == [PutStatus.STORED]
        got = c._run(calls.get_shm(NAMESPACE, [m, *more], pool.segment))
        assert c._run(calls.release([got.lease])) == [True]
        assert len({off for off, _ in got.loc}) == len(more) + 1
        assert [hashlib.sha256(bytes(g)).digest() for g in c.get([m, *more])] == [
            hashlib.sha256(value(x)).digest() for x in [m, *more]
        ]
        assert dict(c.stats()["tiers"]["memory"])["leased_chunks"] == 0


def test_a_segment_of_another_daemon_is_left_alone(daemon_factory: Callable[..., Daemon]) -> None:
    a = warm_daemon(daemon_factory)
    keys = [key(i, "mine") for i in range(3)]
    sums = put_all(a, keys)
    segment = segment_of(a)
    assert a.stop() == 0
    b = warm_daemon(daemon_factory, shm_dir=str(a.shm_dir))  # same directory, other listen addresses
    assert segment.exists() and index_of(segment).exists()
    assert "left by a clean stop of the daemon listening on" in b.log()
    with b.client() as c:
        assert c.get(keys) == [None] * 3
    a.start()
    with a.client() as c:
        assert [sha(g) for g in c.get(keys)] == [sums[k] for k in keys]


def test_a_replaced_container_with_another_host_name_adopts_the_pool(daemon_factory: Callable[..., Daemon]) -> None:
    """A DaemonSet rollout or a recreated compose container (issue 39, item 6): the same
    config, the same /dev/shm and state directory, another host name (the daemon runs in
    a new UTS namespace): the pool is adopted and serves hits, never refused as "another
    installation"."""
    d = warm_daemon(daemon_factory)
    keys = [key(i, "rollout") for i in range(4)]
    sums = put_all(d, keys)
    segment = segment_of(d)
    assert d.stop() == 0
    d.prefix = ["unshare", "--uts", "sh", "-c", 'hostname lmcache-replaced-pod && exec "$@"', "sh"]
    d.start()
    assert d.proc is not None and os.readlink(f"/proc/{d.proc.pid}/ns/uts") != os.readlink("/proc/self/ns/uts")
    assert "warm restart: adopted " + segment.name in d.log() and REFUSED not in d.log()
    with d.client() as c:
        assert c.lookup(keys).tiers == ["memory"] * 4
        assert [sha(g) for g in c.get(keys)] == [sums[k] for k in keys]
        assert memory_stats(c)["hits"] == 4


def test_another_installation_on_the_same_shm_dir_never_adopts(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """What the host name guarded, the installation id still guards: a daemon with the same
    config, /dev/shm and host name but its own state directory (another container sharing
    the host's /dev/shm) is another installation, and starts cold."""
    d = warm_daemon(daemon_factory)
    keys = [key(i, "theirs") for i in range(2)]
    put_all(d, keys)
    assert d.stop() == 0
    d.env = {"XDG_STATE_HOME": str(tmp_path / "another-installation")}
    d.start()
    assert "written by another installation" in d.log()
    with d.client() as c:
        assert c.get(keys) == [None, None]


def test_an_orphaned_segment_of_another_daemon_is_removed_once_old(daemon_factory: Callable[..., Daemon]) -> None:
    """A clean segment whose daemon moved to other addresses would hold host memory
    forever: past warm_restart_max_age_s the next daemon's start removes it."""
    a = warm_daemon(daemon_factory)
    put_all(a, [key(i, "orphan") for i in range(2)])
    segment = segment_of(a)
    assert a.stop() == 0
    young = warm_daemon(daemon_factory, shm_dir=str(a.shm_dir))
    assert segment.exists() and "MiB of host memory" in young.log()
    assert young.stop() == 0
    old = warm_daemon(daemon_factory, shm_dir=str(a.shm_dir), warm_restart_max_age_s=0)
    assert not segment.exists() and not index_of(segment).exists()
    assert "warm_restart_max_age_s" in old.log() and REFUSED in old.log()
    with old.client() as c:  # and the daemon serves
        assert c.put([key(9)], [value(key(9))]) == [PutStatus.STORED]


# -- the index format, without a daemon -------------------------------------------
def _index(**changes: object) -> WarmIndex:
    k = ChunkKey("ns", b"\x01" * 32)
    fields: dict[str, object] = {
        "segment": "lmcache-pool-1-" + "0" * 32,
        "pool_size": 64 * MiB,
        "identity": ("tcp://127.0.0.1:1",),
        "boot_id": "b",
        "written_at": 1.0,
        "chunks": [(k, 0, MiB, False), (ChunkKey("ns", b"\x02" * 32), MiB, 5000, True)],
        "leases": [HeldLease(7, True, 3.5, {"pid": 1, "pidns": 2, "start": 3}, (HeldSlot(2 * MiB, 100, k),))],
    }
    fields.update(changes)
    return WarmIndex(**fields)  # type: ignore[arg-type]


def test_index_round_trips() -> None:
    index = _index()
    assert decode(encode(index)) == index
    check(index, 64 * MiB)


@pytest.mark.parametrize(
    ("index", "reason"),
    [
        (_index(chunks=[(ChunkKey("ns", b"a"), 0, MiB, False), (ChunkKey("ns", b"b"), 4096, 10, False)]), "overlaps"),
        (_index(chunks=[(ChunkKey("ns", b"a"), 63 * MiB, 2 * MiB, False)]), "ends past the pool"),
        (_index(chunks=[(ChunkKey("ns", b"a"), 100, 10, False)]), "not page-aligned"),
        (_index(chunks=[(ChunkKey("ns", b"a"), 0, 10, False)] * 2), "listed twice"),
        (_index(leases=[HeldLease(1, True, 0.0, None, (HeldSlot(0, 10),))]), "overlaps"),
    ],
)
def test_inconsistent_extents_are_refused(index: WarmIndex, reason: str) -> None:
    with pytest.raises(WarmIndexError, match=reason):
        check(decode(encode(index)), 64 * MiB)
