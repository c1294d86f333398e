"""Staged slots: a shared-memory put in one round trip (issue #15, item 1).

A streaming writer's commit stages anonymous pool slots for its next put;
that put copies into them and sends one ``bind``.  Against real daemon
processes and real shared memory, except the SKIPPED case (an in-process
store with a refusing policy: no shipped policy refuses on demand).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lmcache_client import AsyncCacheClient, CacheClient, ErrorCode, PutStatus, ServerError, calls, shm
from lmcache_client.protocol import Op
from lmcache_server.storage import TieredStore
from lmcache_server.storage.base import ChunkKey
from lmcache_server.storage.memory import MemoryTier
from lmcache_server.storage.memory.pool import MemoryPool
from lmcache_server.storage.policy import LRUPolicy

from ...conftest import NAMESPACE, Closer, Daemon, wait_for
from ...security.test_security import NS_A, Keys, start_daemon, stop

MiB = 1 << 20


def key(i: int, tag: str = "staged") -> bytes:
    return hashlib.sha256(f"{tag}-{i}".encode()).digest()


def value(k: bytes, size: int = MiB) -> bytes:
    return hashlib.shake_128(k).digest(size)


def shm_stats(c: CacheClient) -> dict[str, Any]:
    return dict(c.stats()["shm"])


def requests_by_op(d: Daemon) -> dict[str, float]:
    """Requests the daemon answered, by op (its Prometheus counter)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=10) as r:
        body = r.read().decode()
    out: dict[str, float] = {}
    for op, n in re.findall(r'^lmcache_requests_total\{op="(\w+)",outcome="[^"]*"\} (\S+)$', body, re.M):
        out[op] = out.get(op, 0.0) + float(n)
    return out


def staged(c: CacheClient) -> shm.StagedSlots:
    pool = c._pool
    assert pool is not None and pool.staged is not None
    return pool.staged


def test_a_stream_of_puts_is_one_request_each(daemon: Daemon) -> None:
    batches = [[key(10 * b + i) for i in range(2)] for b in range(8)]
    with daemon.client() as c:
        assert c.uses_shared_memory
        before = requests_by_op(daemon)
        for ks in batches:
            assert c.put(ks, [value(k) for k in ks]) == [PutStatus.STORED] * 2
        after = requests_by_op(daemon)
        asked = {op: after.get(op, 0) - before.get(op, 0) for op in ("alloc", "commit", "bind", "release")}
        # The first put is a one-off (alloc+commit), the second stages slots at its
        # commit, every later put is one bind.
        assert asked == {"alloc": 2, "commit": 2, "bind": 6, "release": 0}
        assert c._pool is not None and c._pool.binds == 6
        s = shm_stats(c)
        assert s["binds"] == 6 and s["staged_leases"] == 1 and s["active_staged_leases"] == 1
        assert s["staged_bytes"] == 2 * MiB and s["reserved_bytes"] == 2 * MiB
        assert s["active_write_leases"] == 0
        with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10) as r:
            body = r.read().decode()
        samples = dict(line.rsplit(" ", 1) for line in body.splitlines() if line and not line.startswith("#"))
        assert float(samples["lmcache_shm_binds_total"]) == 6
        assert float(samples['lmcache_shm_leases{kind="staged"}']) == 1
        assert float(samples['lmcache_shm_leases_granted_total{kind="staged"}']) == 1
        assert float(samples['lmcache_shm_leased_bytes{kind="staged"}']) == 2 * MiB
        every = [k for ks in batches for k in ks]
        assert [bytes(g) for g in c.get(every)] == [value(k) for k in every]
    # Closing released the staged slots.
    with daemon.client(shared_memory=False) as frames:
        s = dict(frames.stats()["shm"])
        assert s["reserved_bytes"] == 0 and s["active_staged_leases"] == 0
        assert [bytes(g) for g in frames.get(every)] == [value(k) for k in every]


def test_fill_and_async_puts_use_the_staged_slots(daemon: Daemon) -> None:
    with daemon.client() as c:
        for i in range(4):
            ks = [key(i, "fill")]
            assert c.put_with(ks, [MiB], lambda j, view, k=ks[0]: view.__setitem__(slice(None), value(k))) == [
                PutStatus.STORED
            ]
        assert c._pool is not None and c._pool.binds == 2

    async def stream() -> int:
        async with AsyncCacheClient(daemon.address, NAMESPACE, fail_open=False) as a:
            # Concurrent puts: one uses the staged slots at a time, the others alloc+commit.
            for i in range(3):
                ks = [key(100 + 2 * i + j, "aio") for j in range(2)]
                results = await asyncio.gather(*(a.put([k], [value(k)]) for k in ks))
                assert results == [[PutStatus.STORED]] * 2
            for i in range(4):
                k = key(i, "aio-serial")
                assert await a.put([k], [value(k)]) == [PutStatus.STORED]
            pool = a._pool
            assert pool is not None
            return pool.binds

    assert asyncio.run(stream()) >= 4
    with daemon.client() as c:
        every = [key(i, "fill") for i in range(4)] + [key(100 + i, "aio") for i in range(6)]
        every += [key(i, "aio-serial") for i in range(4)]
        assert [bytes(g) for g in c.get(every)] == [value(k) for k in every]
        assert shm_stats(c)["reserved_bytes"] == 0


def test_a_staged_chunk_is_invisible_until_its_bind(daemon: Daemon) -> None:
    with daemon.client() as writer, daemon.client() as reader:
        for i in range(2):
            writer.put([key(i, "warm-up")], [value(key(i, "warm-up"))])
        st = staged(writer)
        pool = writer._pool
        assert pool is not None
        k = key(1, "hidden")
        offset, length = st.free[0]
        pool.copy_in(offset, value(k))
        assert reader.exists([k]) == [False]
        assert reader.get([k]) == [None]
        assert reader.lookup([k]).hit_chunks == 0
        bound = writer._run(calls.bind(NAMESPACE, [k], [offset], st.lease, pool.segment))
        assert bound.status == [PutStatus.STORED] and len(bound.fresh) == 1 and bound.fresh[0][1] == MiB
        assert bytes(reader.get([k])[0]) == value(k)


def test_exists_leaves_the_slot_staged_and_wrong_sizes_fall_back(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory(max_local_cpu_size="128MiB")  # staged slots up to 4 MiB
    with daemon.client() as c:
        first = key(0, "again")
        for i in range(2):
            c.put([key(i, "again")], [value(key(i, "again"))])
        st = staged(c)
        slots = sorted(st.free)
        assert c.put([first], [value(first)]) == [PutStatus.EXISTS]  # a bind that consumed nothing
        assert staged(c) is st and sorted(st.free) == slots
        assert shm_stats(c)["binds"] == 1
        k = key(5, "again")
        assert c.put([k], [value(k)]) == [PutStatus.STORED]  # the same slot, reused
        assert shm_stats(c)["binds"] == 2 and bytes(c.get([k])[0]) == value(k)
        # A put of another size does not fit: alloc+commit, the old slots released, new ones staged.
        writes = shm_stats(c)["write_leases"]
        big = key(6, "again")
        assert c.put([big], [value(big, 3 * MiB)]) == [PutStatus.STORED]
        s = shm_stats(c)
        assert s["write_leases"] == writes + 1 and s["staged_leases"] == 2 and s["staged_bytes"] == 3 * MiB
        assert staged(c).free[0][1] == 3 * MiB
        big2 = key(7, "again")
        assert c.put([big2], [value(big2, 3 * MiB)]) == [PutStatus.STORED]
        assert shm_stats(c)["binds"] == 3
        assert bytes(c.get([big])[0]) == value(big, 3 * MiB) and bytes(c.get([big2])[0]) == value(big2, 3 * MiB)
        # A duplicate key within one bind: the first stores, the second is EXISTS.
        dup = key(8, "again")
        c.put([key(20, "again")], [value(key(20, "again"))])  # 1 MiB: restaged at 1 MiB
        c.put([key(30, "again"), key(31, "again")], [value(key(30, "again")), value(key(31, "again"))])
        c.put([key(32, "again"), key(33, "again")], [value(key(32, "again")), value(key(33, "again"))])
        binds = shm_stats(c)["binds"]
        assert c.put([dup, dup], [value(dup), value(dup)]) == [PutStatus.STORED, PutStatus.EXISTS]
        assert shm_stats(c)["binds"] == binds + 1
        assert bytes(c.get([dup])[0]) == value(dup)


class _Refusing(LRUPolicy):
    """LRU that refuses keys it is told to (as an admission rule would)."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse: set[bytes] = set()

    def admit(self, key: ChunkKey, size: int, parent: ChunkKey | None) -> bool:
        return key.digest not in self.refuse


def test_skipped_leaves_the_room_staged(closed_at_end: Closer) -> None:
    policy = _Refusing()
    memory = MemoryTier(MemoryPool(16 * MiB, "off"), 0, policy)
    store = closed_at_end(TieredStore(memory))
    rooms = store.stage([MiB, MiB])
    assert rooms is not None and memory.allocator.allocated_bytes == 2 * MiB
    a, b = key(1, "skip"), key(2, "skip")
    policy.refuse.add(b)
    rooms[0].view[:] = value(a)
    assert store.bind("ns", [a, b], rooms) == [PutStatus.STORED, PutStatus.SKIPPED]
    assert memory.counters.skipped == 1 and memory.chunks == 1
    # The refused room is still reserved (unbound), the stored one became the chunk.
    assert memory.allocator.allocated_bytes == 2 * MiB
    policy.refuse.clear()
    rooms[1].view[:] = value(b)
    assert store.bind("ns", [b], [rooms[1]]) == [PutStatus.STORED]
    assert memory.chunks == 2 and memory.allocator.allocated_bytes == 2 * MiB
    assert store.stage([16 * MiB, MiB]) is None  # all or nothing: never more than the pool
    assert memory.chunks == 2 and memory.allocator.allocated_bytes == 2 * MiB


def test_quota_refusals_match_alloc_and_commit(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory(max_local_cpu_size="192MiB", tenant_quotas={"acme": {"memory": "4MiB"}}, cache_policy="lru")
    acme = "m|float16|L2|KV2|D64|tp0of1|c16|tenant=acme"
    with d.client() as staged_c, d.client() as plain:
        # Stream 5 MiB puts elsewhere so staged_c holds a 5 MiB slot.
        for i in range(2):
            k = key(i, "quota-warm")
            staged_c.put([k], [value(k, 5 * MiB)])
        assert staged(staged_c).free[0][1] == 5 * MiB
        big = key(0, "quota-big")
        binds = shm_stats(plain)["binds"]
        assert staged_c.put([big], [value(big, 5 * MiB)], namespace=acme) == [PutStatus.NO_SPACE]
        assert shm_stats(plain)["binds"] == binds + 1 and staged(staged_c).free[0][1] == 5 * MiB
        assert plain.put([big], [value(big, 5 * MiB)], namespace=acme) == [PutStatus.NO_SPACE]  # alloc+commit
        assert plain.exists([big], namespace=acme) == [False]
        # Within the quota both paths evict the tenant's own oldest chunks alike.
        for i in range(6):
            for c, tag in ((staged_c, "q-staged"), (plain, "q-plain")):
                k = key(i, tag)
                assert c.put([k], [value(k)], namespace=acme) == [PutStatus.STORED]
        used = plain.stats()["tiers"]["memory"]["tenants"]["acme"]["used_bytes"]
        assert used == 4 * MiB


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return Keys(tmp_path_factory.mktemp("keys"))


def test_bind_is_checked_like_any_write(keys: Keys, tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "secure", keys.config(), **keys.options("admin"))
    try:
        with (
            d.client(namespace=NS_A, shared_memory=True, **keys.options("tenant-a")) as a,
            d.client(namespace=NS_A, shared_memory=True, **keys.options("reader-a")) as reader,
        ):
            for i in range(2):
                k = key(i, "grant")
                assert a.put([k], [value(k)]) == [PutStatus.STORED]
            st = staged(a)
            pool = a._pool
            assert pool is not None
            # Another namespace with a's own staged slots: FORBIDDEN, the slots stay staged.
            other = "m|float16|L2|KV2|D64|tp0of1|c16|tenant=b"
            with pytest.raises(ServerError) as err:
                a.put([key(9, "grant")], [value(key(9, "grant"))], namespace=other)
            assert err.value.code == ErrorCode.FORBIDDEN
            assert staged(a) is st and len(st.free) == 1
            # A read-only key naming a's lease: FORBIDDEN before the lease is looked at.
            with pytest.raises(ServerError) as err:
                reader._run(calls.bind(NS_A, [key(10, "grant")], [st.free[0][0]], st.lease, pool.segment))
            assert err.value.code == ErrorCode.FORBIDDEN
            k = key(11, "grant")
            assert a.put([k], [value(k)]) == [PutStatus.STORED]
            assert bytes(reader.get([k])[0]) == value(k)
            assert pool.binds == 1
    finally:
        stop(d)


_IDLE_WRITER = """
import hashlib, sys, time
from lmcache_client import CacheClient
c = CacheClient(sys.argv[1], sys.argv[2], fail_open=False)
for i in range(2):
    k = hashlib.sha256(b"idle-%d" % i).digest()
    c.put([k], [hashlib.shake_128(k).digest(1 << 20)])
print("staged", c._pool.staged is not None, flush=True)
time.sleep(600)
"""


def test_an_idle_staged_lease_is_quarantined_until_its_writer_is_gone(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory(shm_lease_timeout_s=1.0)
    writer = subprocess.Popen(
        [sys.executable, "-c", _IDLE_WRITER, d.ipc_address, NAMESPACE], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().split() == ["staged", "True"]
        with d.client() as c:
            assert shm_stats(c)["active_staged_leases"] == 1
            # Idle past its deadline: quarantined (its writer is alive, maybe stalled mid-copy).
            assert wait_for(lambda: shm_stats(c)["active_staged_leases"] == 0)
            s = shm_stats(c)
            assert s["expired_staged"] == 1 and s["expired_writes"] == 0
            assert s["quarantined_bytes"] == MiB and s["reserved_bytes"] == MiB
            writer.send_signal(signal.SIGKILL)
            writer.wait(10)
            assert wait_for(lambda: shm_stats(c)["reserved_bytes"] == 0)
            assert shm_stats(c)["quarantine_released"] == 1
            assert c.stats()["tiers"]["memory"]["allocated_bytes"] == 2 * MiB  # the two chunks stored
    finally:
        writer.kill()


def test_a_writer_back_after_its_lease_lapsed_still_stores(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory(shm_lease_timeout_s=1.0)
    with d.client() as c:
        for i in range(2):
            c.put([key(i, "lapse")], [value(key(i, "lapse"))])
        st = staged(c)
        assert wait_for(lambda: shm_stats(c)["quarantined_bytes"] == MiB)
        # Its next put sees the lease near (past) its deadline: released, then alloc+commit.
        k = key(5, "lapse")
        assert c.put([k], [value(k)]) == [PutStatus.STORED]
        s = shm_stats(c)
        assert s["quarantine_released"] == 1 and s["quarantined_bytes"] == 0
        assert c._pool is not None and c._pool.staged is not st
        # A bind arriving after the deadline (a stalled writer) is refused and frees the slots.
        pool = c._pool
        for i in range(2):
            c.put([key(10 + i, "lapse")], [value(key(10 + i, "lapse"))])
        st = staged(c)
        assert wait_for(lambda: shm_stats(c)["quarantined_bytes"] == MiB)
        with pytest.raises(ServerError) as err:
            c._run(calls.bind(NAMESPACE, [key(20, "lapse")], [st.free[0][0]], st.lease, pool.segment))
        assert err.value.code == ErrorCode.UNKNOWN_LEASE
        assert shm_stats(c)["reserved_bytes"] == 0 and c.exists([key(20, "lapse")]) == [False]
        # The client's own copy of the lease is stale now: its put falls back and stores.
        k = key(21, "lapse")
        assert c.put([k], [value(k)]) == [PutStatus.STORED]
        assert bytes(c.get([k])[0]) == value(k)


def test_reserve_cap_counts_staged_room(daemon_factory: Callable[..., Daemon]) -> None:
    # 256 MiB pool, max_message_size 16 MiB: shm_reserve_cap 64 MiB; staged slots at most 8 MiB.
    d = daemon_factory(max_local_cpu_size="256MiB", max_message_size="16MiB")
    with d.client() as staged_c, d.client() as other:
        for i in range(2):
            k = key(i, "cap")
            staged_c.put([k], [value(k, 4 * MiB)])
        assert shm_stats(other)["reserved_bytes"] == 4 * MiB
        pool = other._shared_pool()
        assert pool is not None

        def alloc(i: int, size: int) -> int:
            grant = other._run(calls.alloc(NAMESPACE, [key(i, "cap-other")], [size], pool.segment))
            assert grant.lease is not None
            return grant.lease

        held = [alloc(i, size * MiB) for i, size in enumerate((16, 16, 16, 11))]
        last = alloc(9, MiB)  # 4 staged + 59 + 1: the cap
        with pytest.raises(ServerError) as err:
            alloc(10, MiB)
        assert err.value.code == ErrorCode.BUSY
        # Staging past the reservation cap is declined; the commit itself succeeds.
        statuses, staged_now = other._run(calls.commit_staging(last, pool.segment, [4 * MiB]))
        assert statuses == [PutStatus.STORED] and staged_now is None
        other._run(calls.release(held))
        statuses, staged_now = other._run(calls.commit_staging(alloc(11, MiB), pool.segment, [4 * MiB]))
        assert statuses == [PutStatus.STORED] and staged_now is not None
        assert shm_stats(other)["staged_bytes"] == 8 * MiB
        # Past 1/32 of the pool in staged slots: declined too.
        statuses, declined = other._run(calls.commit_staging(alloc(12, MiB), pool.segment, [MiB]))
        assert statuses == [PutStatus.STORED] and declined is None
        other._run(calls.release([staged_now.lease]))
        assert shm_stats(other)["staged_bytes"] == 4 * MiB


def test_a_small_pool_stages_nothing(daemon_factory: Callable[..., Daemon]) -> None:
    # A 16 MiB pool: 1/32 of it is less than one 1 MiB put, so every put is alloc+commit
    # and the cache keeps all its room for chunks.
    d = daemon_factory(max_local_cpu_size="16MiB", cache_policy="lru")
    with d.client() as c:
        for i in range(20):
            k = key(i, "small")
            assert c.put([k], [value(k)]) == [PutStatus.STORED]
        s = shm_stats(c)
        assert s["staged_leases"] == 0 and s["binds"] == 0
        assert c.stats()["tiers"]["memory"]["chunks"] == 16


def test_a_restarted_daemon_gets_a_new_hello_and_the_put_still_stores(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory()
    with d.client() as c:
        for i in range(2):
            c.put([key(i, "restart")], [value(key(i, "restart"))])
        assert staged(c) is not None
        assert d.stop() == 0
        d.start()
        k = key(5, "restart")
        assert c.put([k], [value(k)]) == [PutStatus.STORED]  # STALE_SEGMENT -> hello, remap, alloc+commit
        assert bytes(c.get([k])[0]) == value(k)
        for i in range(3):
            k = key(10 + i, "restart")
            assert c.put([k], [value(k)]) == [PutStatus.STORED]
        assert shm_stats(c)["binds"] == 2


def test_a_warm_restart_quarantines_staged_slots(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory(warm_restart=True, cache_policy="lru")
    with d.client() as c:
        for i in range(2):
            c.put([key(i, "warm")], [value(key(i, "warm"))])
        st = staged(c)
        assert d.stop() == 0
        d.start()
        assert "warm restart: adopted" in d.log()
        s = shm_stats(c)
        assert s["quarantined_bytes"] == MiB and s["active_staged_leases"] == 0
        # The same segment: the client's bind is refused (UNKNOWN_LEASE, the slot freed)
        # and the put falls back to alloc+commit.
        k = key(5, "warm")
        assert c.put([k], [value(k)]) == [PutStatus.STORED]
        assert c._pool is not None and c._pool.staged is not st
        s = shm_stats(c)
        assert s["quarantined_bytes"] == 0 and s["quarantine_released"] == 1
        assert [bytes(g) for g in c.get([key(0, "warm"), key(1, "warm"), k])] == [
            value(key(0, "warm")),
            value(key(1, "warm")),
            value(k),
        ]


def test_malformed_binds_are_bad_requests_and_the_daemon_keeps_serving(daemon: Daemon) -> None:
    with daemon.client() as c:
        for i in range(2):
            c.put([key(i, "bad")], [value(key(i, "bad"))])
        st = staged(c)
        pool = c._pool
        assert pool is not None
        offset = st.free[0][0]
        k = key(9, "bad")
        grant = c._run(calls.alloc(NAMESPACE, [key(8, "bad")], [MiB], pool.segment))

        def bind(**fields: Any) -> calls.Call[Any]:
            base = {"lease": st.lease, "shm": pool.segment, "slots": [offset]}
            return calls.Call(Op.BIND, lambda r, _: r, NAMESPACE, [k], fields={**base, **fields})

        cases = [
            bind(lease="x"),
            bind(lease=None),
            bind(slots=None),
            bind(slots="x"),
            bind(slots=[]),
            bind(slots=[offset, offset]),
            bind(slots=[offset + 4096]),
            bind(slots=[1.5]),
            bind(slots=[True]),
            bind(lease=grant.lease),  # an alloc's lease holds no staged slots
            bind(tokens="x"),
            calls.Call(Op.COMMIT, lambda r, _: r, fields={"lease": st.lease, "shm": pool.segment}),
            calls.Call(Op.COMMIT, lambda r, _: r, fields={"lease": grant.lease, "shm": pool.segment, "stage": "x"}),
            calls.Call(Op.COMMIT, lambda r, _: r, fields={"lease": grant.lease, "shm": pool.segment, "stage": [0]}),
        ]
        for call in cases:
            with pytest.raises(ServerError) as err:
                c._run(call)
            assert err.value.code == ErrorCode.BAD_REQUEST, (call.fields, err.value)
        with pytest.raises(ServerError) as err:
            c._run(bind(shm="stale"))
        assert err.value.code == ErrorCode.STALE_SEGMENT
        with pytest.raises(ServerError) as err:
            c._run(bind(lease=12345))
        assert err.value.code == ErrorCode.UNKNOWN_LEASE
        assert c.exists([k]) == [False]
        # Nothing was consumed: the staged slot and the alloc still work.
        assert c._run(calls.commit(grant.lease, pool.segment)) == [PutStatus.STORED]
        assert c.put([k], [value(k)]) == [PutStatus.STORED]
        assert bytes(c.get([k])[0]) == value(k)
        assert shm_stats(c)["binds"] == 1


def test_token_ids_sent_with_a_bind_are_announced(daemon_factory: Callable[..., Daemon]) -> None:
    from lmcache_client.keys import chunk_keys, chunk_tokens

    from ...events.test_events import CHUNK, NS, events_daemon, prompt, quiet

    d = events_daemon(daemon_factory)
    with d.client(namespace=NS) as c:
        for seed in range(4):  # one put per prompt of one chunk: the third and fourth are binds
            tokens = prompt(seed, 1)
            keys, toks = chunk_keys(tokens, CHUNK), chunk_tokens(tokens, CHUNK)
            assert c.put(keys, [value(keys[0])], tokens=toks) == [PutStatus.STORED]
        assert shm_stats(c)["binds"] == 2
        assert quiet(c, announced_chunks=4)["announced_chunks"] == 4
        # Put again with tokens by bind: EXISTS, announced once only.
        tokens = prompt(0, 1)
        keys, toks = chunk_keys(tokens, CHUNK), chunk_tokens(tokens, CHUNK)
        assert c.put(keys, [value(keys[0])], tokens=toks) == [PutStatus.EXISTS]
        assert shm_stats(c)["binds"] == 3
        assert quiet(c)["announced_chunks"] == 4
        # Bad token ids on a bind: BAD_REQUEST, nothing stored, the slot still staged.
        other = prompt(9, 1)
        bad = chunk_tokens(prompt(8, 1), CHUNK)
        with pytest.raises(ServerError) as err:
            c.put(chunk_keys(other, CHUNK), [value(b"x")], tokens=bad)
        assert err.value.code == ErrorCode.BAD_REQUEST
        assert c.exists(chunk_keys(other, CHUNK)) == [False] and len(staged(c).free) == 1
