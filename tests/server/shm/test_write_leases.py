"""Write leases of the shared-memory path (issue 29 items 3 and 6): they never wedge
the pool (every quarantine ends, a nonce frees a grant the client never saw, a late
alloc is not granted) and never hand a committed chunk's extent back."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest

from lmcache_client import CacheClient, ErrorCode, ServerError, calls, shm
from lmcache_client.protocol import ProtocolError
from lmcache_server.server.shm import QUARANTINE_FACTOR
from lmcache_server.storage import ChunkKey

from ...conftest import Daemon as RealDaemon
from ...conftest import wait_for
from ._shm_model_support import NS, Daemon, alive_owner, digest, new_pool, size_of, value


def _read(d: Daemon, k: int) -> bytes:
    chunk = d.memory.lease(ChunkKey(NS, digest(k)))
    assert chunk is not None
    try:
        return bytes(chunk.data)
    finally:
        chunk.release()


def test_a_fault_while_restaging_keeps_the_committed_chunk_off_the_lease() -> None:
    """Item 6: bind commits K, then restaging its fresh slot fails: the lease must
    not list K's extent any more, so its release cannot free K and a later put
    cannot overwrite K's bytes."""
    d = Daemon(new_pool())
    staged = d.shm.stage([size_of(1), size_of(1)], alive_owner())
    assert staged is not None
    lease, rooms, _ = staged
    room = rooms[0]
    room.view[:] = value(1)

    def broken(sizes: object) -> None:
        raise RuntimeError("planted: restaging failed")

    with mock.patch.object(d.store, "stage", broken), pytest.raises(RuntimeError):
        d.shm.bind(lease, NS, [digest(1)], [room.offset], None, 0)
    assert room.offset not in [r.offset for r in d.shm.table.writes[lease].reservations]
    d.shm.release([lease])
    while d.memory.allocator.free_bytes >= size_of(1):  # take every free extent (no eviction)
        r = d.memory.reserve_room(size_of(1))
        assert r is not None
        r.view[:] = b"\xee" * r.size
    assert _read(d, 1) == value(1)


def test_every_quarantine_ends_within_its_bound_even_for_a_live_owner() -> None:
    """Item 3: expired write slots of a live, observable writer that never comes
    back are freed after QUARANTINE_FACTOR lease timeouts."""
    d = Daemon(new_pool())
    r = d.memory.reserve_room(size_of(1))
    assert r is not None
    _, deadline = d.shm.grant_writes([r], alive_owner())
    d.shm.sweep(deadline + 0.001)
    assert d.shm.stats()["quarantined_bytes"] == r.size
    d.shm.sweep(deadline + (QUARANTINE_FACTOR + 1) * d.shm.timeout_s + 1)
    assert d.shm.stats()["quarantined_bytes"] == 0


def test_a_client_chosen_nonce_releases_a_grant_never_seen() -> None:
    """Item 3: a release naming the alloc's nonce frees the grant (made before or
    after the release arrives)."""
    d = Daemon(new_pool())
    r = d.memory.reserve_room(size_of(1))
    assert r is not None
    d.shm.grant_writes([r], alive_owner(), nonce=12345)
    assert d.shm.release_nonces([12345]) == [True]
    assert d.shm.reserved_bytes() == 0
    # released first, granted later: the grant is aborted at once
    d.shm.release_nonces([777])
    r = d.memory.reserve_room(size_of(1))
    assert r is not None
    with pytest.raises(ProtocolError):
        d.shm.grant_writes([r], alive_owner(), nonce=777)
    assert d.shm.reserved_bytes() == 0


# -- with a real daemon ----------------------------------------------------------------
MiB = 1 << 20
TENANT_A = "m|float16|L2|KV2|D64|tp0of1|c16|tenant=a"
TENANT_B = "m|float16|L2|KV2|D64|tp0of1|c16|tenant=b"


def _key(i: int, tag: str) -> bytes:
    return hashlib.sha256(b"%s-%d" % (tag.encode(), i)).digest()


def _shm_stats(c: CacheClient) -> dict[str, Any]:
    stats: dict[str, Any] = c.stats()["shm"]
    return stats


def _mapped(c: CacheClient, tag: str) -> str:
    """Map the pool (one ordinary shm put) and return its segment token."""
    k = _key(0, tag)
    c.put([k], [b"\x01" * MiB])  # with a 0.1 s lease the client may find no time to copy: FAILED
    assert c._pool is not None
    return c._pool.segment


def test_allocs_never_committed_do_not_block_shm_puts(daemon_factory: Callable[..., RealDaemon]) -> None:
    """Item 3: raw allocs of a live writer that never commits nor releases;
    30 lease timeouts later nothing is quarantined and another tenant's alloc
    is granted.  Meanwhile tenant a alone cannot take the whole reserve cap."""
    timeout = 0.1
    d = daemon_factory(shm_lease_timeout_s=timeout, max_local_cpu_size="64MiB")
    with d.client(fail_open=False, staged_puts=False) as c:
        segment = _mapped(c, "never")
        granted = refused = 0
        for i in range(16):
            try:
                grant = c._run(calls.alloc(TENANT_A, [_key(i, "never")], [4 * MiB], segment, shm.owner()))
            except ServerError as err:
                assert err.code == ErrorCode.BUSY
                refused += 1
                continue
            granted += grant.lease is not None
        assert granted and refused  # a is charged: it never holds more than half the cap
        other = c._run(calls.alloc(TENANT_B, [_key(1, "other")], [MiB], segment, shm.owner()))
        assert other.lease is not None  # b still gets room while a holds its share
        c._run(calls.release([other.lease]))
        assert wait_for(lambda: _shm_stats(c)["quarantined_bytes"] > 0, timeout_s=10)
        time.sleep(30 * timeout)
        assert wait_for(lambda: _shm_stats(c)["quarantined_bytes"] == 0, timeout_s=10)
        assert _shm_stats(c)["quarantine_timed_out"] >= granted
        grant = c._run(calls.alloc(TENANT_B, [_key(2, "other")], [4 * MiB], segment, shm.owner()))
        assert grant.lease is not None


def test_an_alloc_past_its_deadline_is_not_granted(daemon_factory: Callable[..., RealDaemon]) -> None:
    d = daemon_factory()
    with d.client(fail_open=False, staged_puts=False) as c:
        segment = _mapped(c, "late")
        with pytest.raises(ServerError) as err:
            c._run(calls.alloc(TENANT_B, [_key(1, "late")], [MiB], segment, shm.owner(), deadline=time.monotonic() - 1))
        assert err.value.code == ErrorCode.BUSY
        assert _shm_stats(c)["reserved_bytes"] == 0
        grant = c._run(
            calls.alloc(TENANT_B, [_key(2, "late")], [MiB], segment, shm.owner(), deadline=time.monotonic() + 5)
        )
        assert grant.lease is not None


def test_a_nonce_releases_a_grant_the_client_never_saw(daemon_factory: Callable[..., RealDaemon]) -> None:
    d = daemon_factory()
    with d.client(fail_open=False, staged_puts=False) as c:
        segment = _mapped(c, "nonce")
        # Granted, reply "lost": the client names its nonce, the daemon frees the grant.
        c._run(calls.alloc(TENANT_B, [_key(1, "nonce")], [MiB], segment, shm.owner(), nonce=4242))
        assert _shm_stats(c)["reserved_bytes"] == MiB
        assert c._run(calls.release([4242])) == [True]
        assert _shm_stats(c)["reserved_bytes"] == 0
        # Released before its grant: the grant is refused and nothing stays reserved.
        assert c._run(calls.release([4343])) == [False]
        with pytest.raises(ServerError) as err:
            c._run(calls.alloc(TENANT_B, [_key(2, "nonce")], [MiB], segment, shm.owner(), nonce=4343))
        assert err.value.code == ErrorCode.UNKNOWN_LEASE
        assert _shm_stats(c)["reserved_bytes"] == 0


def test_a_bind_answered_internal_gives_its_staged_lease_up(daemon_factory: Callable[..., RealDaemon]) -> None:
    """Item 6, client side: a bind error that does not say "nothing consumed"
    (INTERNAL) is treated as an unanswered bind: the staged lease is dropped and
    released, its slots never written again (one of them may hold a committed chunk)."""
    d = daemon_factory(max_local_cpu_size="128MiB")
    with d.client() as c:
        for i in range(2):
            k = _key(i, "internal")
            c.put([k], [b"\x02" * MiB])
        pool = c._pool
        assert pool is not None and pool.staged is not None
        st = pool.staged
        flow = shm._put_staged(pool, "ns", [_key(5, "internal")], [MiB], lambda i, o, n: None, None)
        ask = next(flow)
        assert isinstance(ask, shm.Ask)
        with pytest.raises(ServerError):
            flow.throw(ServerError(ErrorCode.INTERNAL, "planted"))
        assert pool.staged is None and st.lease in pool.unsettled
        assert all(slot[0] != ask.call.fields["slots"][0] for slot in st.free)
