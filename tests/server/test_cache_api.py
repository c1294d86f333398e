"""The operator's cache API over the wire (issue 27 items 3 and 6): pin, unpin, delete,
prefetch and a namespace's listing, through the real daemon process and real sockets.

Memory pressure is made by putting fillers into an 8 MiB pool (cache_policy lru);
chunks are parked on disk with ``park_on_disk`` (evicted, spilled, daemon restarted).
Two tenants with ``auth: curve`` use the keys and grants of security/test_security.py.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lmcache_client import AsyncCacheClient, CacheClient, ErrorCode, PutStatus, ServerError
from lmcache_client.protocol import KEY_BYTES

from ..conftest import NAMESPACE, Daemon, RedisServer, disk_stats, wait_for
from ..security.test_security import NS_A, NS_B, Keys, start_daemon, stop
from .test_prefetch import park_on_disk

KiB = 1 << 10
MiB = 1 << 20
CHUNK = 512 * KiB


def put_chunks(c: CacheClient, n: int, size: int = CHUNK, namespace: str = NAMESPACE) -> dict[bytes, bytes]:
    chunks = {os.urandom(KEY_BYTES): os.urandom(size) for _ in range(n)}
    assert c.put(list(chunks), list(chunks.values()), namespace=namespace) == [PutStatus.STORED] * n
    return chunks


def flood(c: CacheClient, total: int = 10 * MiB) -> None:
    """Put ``total`` bytes of fresh chunks: everything evictable in an 8 MiB pool goes."""
    for _ in range(total // CHUNK):
        assert c.put([os.urandom(KEY_BYTES)], [os.urandom(CHUNK)]) == [PutStatus.STORED]


def listing(c: CacheClient, namespace: str = NAMESPACE) -> dict[str, int]:
    return dict(c.stats(namespace=namespace)["namespace"])


def test_pinned_chunks_stay_through_pressure_and_go_once_unpinned(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory(max_local_cpu_size="8MiB", cache_policy="lru")
    with daemon.client() as c:
        pinned = put_chunks(c, 4)
        loose = put_chunks(c, 4)
        assert c.pin(list(pinned)) == [True] * 4
        assert listing(c)["pinned_chunks"] == 4 and listing(c)["pinned_bytes"] == 4 * CHUNK
        flood(c)
        assert c.exists(list(loose)) == [False] * 4  # the pressure evicted the unpinned ones
        assert c.lookup(list(pinned)).tiers == ["memory"] * 4
        assert c.get(list(pinned)) == list(pinned.values())  # and the pinned bytes are intact
        assert c.unpin(list(pinned)) == [True] * 4
        assert c.unpin(list(pinned)) == [False] * 4  # no longer pinned
        assert listing(c)["pinned_chunks"] == 0 and listing(c)["pinned_bytes"] == 0
        flood(c)
        assert c.exists(list(pinned)) == [False] * 4


def test_a_pin_past_max_pinned_fraction_is_refused_whole(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory(max_local_cpu_size="8MiB", max_pinned_fraction=0.25)  # 2 MiB: 4 chunks
    with daemon.client() as c:
        chunks = list(put_chunks(c, 6))
        assert c.pin(chunks[:3]) == [True] * 3
        with pytest.raises(ServerError) as err:
            c.pin(chunks[3:5])  # 2 more would be 5 chunks, 2.5 MiB
        assert err.value.code == ErrorCode.PIN_LIMIT
        assert "max_pinned_fraction 0.25" in err.value.message and "nothing was pinned" in err.value.message
        assert listing(c)["pinned_chunks"] == 3  # nothing of the refused request was pinned
        assert c.pin(chunks[:4]) == [True] * 4  # three already pinned cost nothing: one more fits
        assert listing(c)["pinned_bytes"] == 4 * CHUNK


def test_delete_removes_pinned_and_plain_chunks(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory()
    with daemon.client() as c:
        chunks = list(put_chunks(c, 3))
        assert c.pin(chunks[:1]) == [True]
        missing = os.urandom(KEY_BYTES)
        assert c.delete([*chunks, missing]) == [True, True, True, False]
        assert c.exists(chunks) == [False] * 3
        assert listing(c)["chunks"] == 0 and listing(c)["pinned_chunks"] == 0


def test_prefetch_and_pin_promote_from_disk(disk_daemon: Callable[..., Daemon]) -> None:
    daemon = disk_daemon(cache_policy="lru")
    sizes = [CHUNK] * 4
    keys, data = park_on_disk(daemon, sizes)
    missing = os.urandom(KEY_BYTES)
    with daemon.client() as c:
        held = listing(c)
        assert held["chunks"] == 0 and held["disk_chunks"] >= 4 and "redis_chunks" not in held
        result = c.prefetch([*keys[:2], missing])
        assert result.in_memory == [True, True, False]
        assert (result.was_in_memory, result.promoted, result.promoted_bytes, result.declined) == (0, 2, 2 * CHUNK, 0)
        assert c.lookup(keys[:2]).tiers == ["memory"] * 2
        assert c.get(keys[:2]) == data[:2]
        again = c.prefetch(keys[:2])  # already in memory: nothing to do
        assert (again.was_in_memory, again.promoted) == (2, 0)
        # pin of chunks on disk: promoted first, then pinned
        assert c.pin([*keys[2:], missing]) == [True, True, False]
        after = listing(c)
        assert after["chunks"] == 4 and after["stored_bytes"] == 4 * CHUNK
        assert after["pinned_chunks"] == 2 and after["pinned_bytes"] == 2 * CHUNK
        assert after["disk_chunks"] == held["disk_chunks"]  # a promotion copies; the disk keeps its copy
        flood(c)
        wait_for(lambda: disk_stats(c)["queued_spills"] == 0)
        assert c.lookup(keys[2:]).tiers == ["memory"] * 2
        assert c.get(keys[2:]) == data[2:]


def test_the_async_client_prefetches_too(disk_daemon: Callable[..., Daemon]) -> None:
    daemon = disk_daemon(cache_policy="lru")
    keys, data = park_on_disk(daemon, [CHUNK] * 2)

    async def main() -> None:
        async with AsyncCacheClient(daemon.address, NAMESPACE, fail_open=False) as c:
            result = await c.prefetch(keys)
            assert result.in_memory == [True, True] and result.promoted == 2
            assert (await c.lookup(keys)).tiers == ["memory"] * 2

    asyncio.run(main())
    with daemon.client() as c:
        assert c.get(keys) == data


def test_pin_and_prefetch_promote_from_redis(daemon_factory: Callable[..., Daemon], redis_server: RedisServer) -> None:
    daemon = daemon_factory(remote_url=redis_server.url)
    with daemon.client() as c:
        chunks = put_chunks(c, 4)
        wait_for(lambda: (r := c.stats()["tiers"]["redis"])["stores"] >= 4 and r["queued_writes"] == 0)
    assert daemon.stop() == 0
    daemon.start()  # memory starts empty; Redis keeps the chunks
    keys = list(chunks)
    with daemon.client() as c:
        wait_for(lambda: c.stats()["tiers"]["redis"]["up"])
        assert listing(c)["chunks"] == 0
        assert c.pin(keys[:2]) == [True, True]
        result = c.prefetch(keys[2:])
        assert result.in_memory == [True, True] and result.promoted_bytes == 2 * CHUNK
        assert c.lookup(keys).tiers == ["memory"] * 4
        assert (listing(c)["pinned_chunks"], listing(c)["pinned_bytes"]) == (2, 2 * CHUNK)
        assert c.get(keys) == list(chunks.values())


def test_prefetch_is_bounded_by_the_in_flight_budget(disk_daemon: Callable[..., Daemon]) -> None:
    """A budget of 1 MiB: prefetches hold at most half of it, so no 768 KiB chunk fits."""
    daemon = disk_daemon(cache_policy="lru", max_inflight_bytes="1MiB", max_message_size="1MiB")
    keys, _ = park_on_disk(daemon, [768 * KiB] * 2)
    with daemon.client() as c:
        result = c.prefetch(keys)
        assert result.in_memory == [False, False] and result.promoted == 0 and result.declined == 2
        assert c.stats()["prefetch"]["declined"] >= 1


def test_a_warm_restart_keeps_pins_and_a_cold_one_drops_them(daemon_factory: Callable[..., Daemon]) -> None:
    warm = daemon_factory(max_local_cpu_size="8MiB", warm_restart=True)
    with warm.client() as c:
        chunks = list(put_chunks(c, 3))
        assert c.pin(chunks[:2]) == [True, True]
    assert warm.stop() == 0
    warm.start()
    with warm.client() as c:
        assert listing(c)["pinned_chunks"] == 2 and listing(c)["pinned_bytes"] == 2 * CHUNK
        assert c.unpin(chunks) == [True, True, False]
    cold = daemon_factory(max_local_cpu_size="8MiB")  # warm_restart off in tests
    with cold.client() as c:
        assert c.pin(list(put_chunks(c, 1))) == [True]
    assert cold.stop() == 0
    cold.start()
    with cold.client() as c:
        assert listing(c)["pinned_chunks"] == 0 and listing(c)["chunks"] == 0


# -- two tenants ---------------------------------------------------------------------------
@pytest.fixture
def tenants(tmp_path: Path) -> Iterator[tuple[Daemon, Keys]]:
    keys = Keys(tmp_path / "keys")
    daemon = start_daemon(tmp_path / "daemon", keys.config(), **keys.options("admin"))
    try:
        yield daemon, keys
    finally:
        stop(daemon)


def test_a_tenant_acts_on_its_own_namespaces_only(tenants: tuple[Daemon, Keys]) -> None:
    daemon, keys = tenants
    with (
        daemon.client(**keys.options("tenant-a")) as a,
        daemon.client(**keys.options("tenant-b")) as b,
        daemon.client(**keys.options("reader-a")) as reader,
    ):
        mine = list(put_chunks(a, 2, namespace=NS_A))
        theirs = list(put_chunks(b, 1, namespace=NS_B))
        for op in (b.pin, b.unpin, b.delete, b.prefetch):
            with pytest.raises(ServerError) as err:
                op(mine, namespace=NS_A)
            assert err.value.code == ErrorCode.FORBIDDEN, op
        with pytest.raises(ServerError) as err:
            b.stats(namespace=NS_A)  # the listing
        assert err.value.code == ErrorCode.FORBIDDEN
        # read-only: may prefetch (as a lookup with prefetch: true) and list, not pin or delete
        assert reader.prefetch(mine, namespace=NS_A).in_memory == [True, True]
        assert reader.stats(namespace=NS_A)["namespace"]["chunks"] == 2
        for op in (reader.pin, reader.delete):
            with pytest.raises(ServerError) as err:
                op(mine, namespace=NS_A)
            assert err.value.code == ErrorCode.FORBIDDEN
        assert a.pin(mine, namespace=NS_A) == [True, True]
        seen = a.stats(namespace=NS_A)["namespace"]
        assert (seen["chunks"], seen["pinned_chunks"], seen["pinned_bytes"]) == (2, 2, 2 * CHUNK)
        assert b.stats(namespace=NS_B)["namespace"]["pinned_chunks"] == 0
        assert a.delete(mine, namespace=NS_A) == [True, True]
        assert b.exists(theirs, namespace=NS_B) == [True]  # B's chunks untouched
