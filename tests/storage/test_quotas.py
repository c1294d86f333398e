"""Per-tenant quotas (tenant_quotas): a tenant over its cap evicts its own chunks only."""

from __future__ import annotations

import hashlib
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmcache_client import ErrorCode, Namespace, PutStatus, ServerError, calls

from ..conftest import Daemon, wait_for

MiB = 1 << 20


def ns(tenant: str | None) -> str:
    return str(Namespace("quota-model", "float16", 2, 2, 64, 16, tenant=tenant or "").wire())


def key(tag: str, i: int) -> bytes:
    return hashlib.sha256(f"{tag}-{i}".encode()).digest()


def data(k: bytes, size: int = MiB) -> bytes:
    return hashlib.shake_128(k).digest(size)


def metrics(d: Daemon) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def test_memory_quota_evicts_within_the_tenant(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory(max_local_cpu_size="32MiB", tenant_quotas={"acme": {"memory": "4MiB"}}, cache_policy="lru")
    acme, other, plain = ns("acme"), ns("other"), ns(None)
    with d.client() as c:
        mine = [key("other", i) for i in range(6)] + [key("plain", i) for i in range(6)]
        for i in range(6):
            assert c.put([mine[i]], [data(mine[i])], namespace=other) == [PutStatus.STORED]
            assert c.put([mine[6 + i]], [data(mine[6 + i])], namespace=plain) == [PutStatus.STORED]
        theirs = [key("acme", i) for i in range(10)]
        for k in theirs:
            assert c.put([k], [data(k)], namespace=acme) == [PutStatus.STORED]
        # acme holds at most its 4 MiB: its 4 newest chunks (LRU within the tenant).
        assert c.exists(theirs, namespace=acme) == [False] * 6 + [True] * 4
        assert [bytes(b) for b in c.get(theirs[6:], namespace=acme)] == [data(k) for k in theirs[6:]]
        # Nobody else lost a chunk, though the pool had room to spare only for acme's eviction.
        assert c.exists(mine[:6], namespace=other) == [True] * 6
        assert c.exists(mine[6:], namespace=plain) == [True] * 6
        tenants = c.stats()["tiers"]["memory"]["tenants"]
        assert tenants == {"acme": {"limit_bytes": 4 * MiB, "used_bytes": 4 * MiB, "quota_evictions": 6}}
        # A chunk larger than the whole quota is refused, nothing evicted for it.
        big = key("acme-big", 0)
        assert c.put([big], [data(big, 5 * MiB)], namespace=acme) == [PutStatus.NO_SPACE]
        assert c.exists(theirs[6:], namespace=acme) == [True] * 4
    text = metrics(d)
    assert 'lmcache_tenant_used_bytes{tenant="acme",tier="memory"} 4.194304e+06' in text
    assert 'lmcache_tenant_quota_bytes{tenant="acme",tier="memory"} 4.194304e+06' in text
    assert 'lmcache_tenant_quota_evictions_total{tenant="acme",tier="memory"} 6.0' in text


def test_quota_never_evicts_leased_chunks(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory(max_local_cpu_size="32MiB", tenant_quotas={"acme": {"memory": "2MiB"}})
    acme = ns("acme")
    held = [key("held", i) for i in range(2)]
    with d.client() as reader, d.client() as writer:
        assert reader.put(held, [data(k) for k in held], namespace=acme) == [PutStatus.STORED] * 2
        pool = reader._shared_pool()
        assert pool is not None
        grant = reader._run(calls.get_shm(acme, held, pool.segment))  # a read lease on both
        k = key("new", 0)
        assert writer.put([k], [data(k)], namespace=acme) == [PutStatus.NO_SPACE]
        assert reader._run(calls.release([grant.lease])) == [True]
        assert writer.put([k], [data(k)], namespace=acme) == [PutStatus.STORED]
        assert sum(writer.exists(held, namespace=acme)) == 1


def test_a_one_byte_pin_flood_stops_at_the_tenants_share(daemon_factory: Callable[..., Daemon]) -> None:
    """Issue 39 item 3: every chunk holds at least one 4 KiB page of the pool, so
    quotas and pins charge that extent.  Before, a tenant with a 1 MiB quota
    pinned 16,384 one-byte chunks (16 KiB of payload) and filled the whole
    64 MiB pool: every other tenant's put was NO_SPACE.  Now its pins stop at
    its share (max_pinned_fraction 0.5 of its quota: 128 pages), it holds at
    most its quota, and another tenant's puts are stored."""
    d = daemon_factory(
        max_local_cpu_size="64MiB", tenant_quotas={"acme": {"memory": "1MiB"}}, cache_policy="lru", warm_restart=True
    )
    acme, other = ns("acme"), ns("other")
    pinned, pins_refused, stored = 0, False, 0
    with d.client() as c:
        for batch in range(16384 // 64):
            keys = [key(f"flood-{batch}", i) for i in range(64)]
            statuses = c.put(keys, [b"x"] * len(keys), namespace=acme)
            assert set(statuses) <= {PutStatus.STORED, PutStatus.NO_SPACE}
            stored += statuses.count(PutStatus.STORED)
            for k in keys:  # one at a time, as a flood that wants every pin it can get
                if pins_refused:
                    break
                try:
                    pinned += sum(c.pin([k], namespace=acme))
                except ServerError as err:
                    assert err.code == ErrorCode.PIN_LIMIT and "tenant acme's memory quota" in err.message
                    pins_refused = True
        assert pinned == 128 and stored == 16384  # unpinned, its own chunks make room for its next ones
        listing = c.stats(namespace=acme)["namespace"]
        assert (listing["pinned_chunks"], listing["pinned_bytes"]) == (128, 128 * 4096)
        tenants = c.stats()["tiers"]["memory"]["tenants"]
        assert tenants["acme"]["used_bytes"] == MiB  # 256 one-byte chunks: 256 pages held in the pool
        # Another tenant fills the rest of the pool.
        theirs = [key("other", i) for i in range(62)]
        for k in theirs:
            assert c.put([k], [data(k)], namespace=other) == [PutStatus.STORED]
    # The pins survive a warm restart, charged the same.
    assert d.stop() == 0
    d.start()
    with d.client() as c:
        listing = c.stats(namespace=acme)["namespace"]
        assert (listing["pinned_chunks"], listing["pinned_bytes"]) == (128, 128 * 4096)
        assert c.stats()["tiers"]["memory"]["tenants"]["acme"]["used_bytes"] == MiB
        assert c.exists(theirs, namespace=other) == [True] * 62
        k = key("other-after", 0)
        assert c.put([k], [data(k)], namespace=other) == [PutStatus.STORED]


def test_disk_quota_evicts_within_the_tenant(daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    d = daemon_factory(
        max_local_cpu_size="8MiB",
        local_disk=f"file://{tmp_path}/spill",
        max_local_disk_size="256MiB",
        tenant_quotas={"acme": {"disk": "4MiB"}},
        cache_policy="lru",
    )
    acme, other = ns("acme"), ns("other")
    with d.client() as c:
        # 24 MiB per tenant through an 8 MiB pool: most of it spills to disk.
        for i in range(24):
            for tenant, space in (("acme", acme), ("other", other)):
                k = key(tenant, i)
                assert c.put([k], [data(k)], namespace=space) == [PutStatus.STORED]

        def settled() -> dict[str, Any] | None:
            disk = c.stats()["tiers"]["disk"]
            return disk if disk["queued_spills"] == 0 else None

        disk = wait_for(settled)
        acme_disk = disk["tenants"]["acme"]
        # A 1 MiB chunk takes 1 MiB + a 4 KiB header block on disk: 3 fit in 4 MiB.
        assert acme_disk["limit_bytes"] == 4 * MiB
        assert 3 * (MiB + 4096) == acme_disk["used_bytes"]
        assert acme_disk["quota_evictions"] >= 10
        # The other tenant kept every chunk that spilled (the disk bound is far away).
        counts = c.stats(namespace=other)["namespace"]
        assert counts["chunks"] + counts["disk_chunks"] == 24
        acme_counts = c.stats(namespace=acme)["namespace"]
        assert acme_counts["disk_chunks"] == 3
    assert sample_value(metrics(d), "lmcache_tenant_used_bytes", tier="disk", tenant="acme") == 3 * (MiB + 4096)
    # A quota lowered across a restart applies to what the disk already holds.
    assert d.stop() == 0
    d.config["tenant_quotas"] = {"acme": {"disk": "2MiB"}}
    d.start()
    with d.client() as c:
        acme_disk = c.stats()["tiers"]["disk"]["tenants"]["acme"]
        assert acme_disk["used_bytes"] == MiB + 4096 and acme_disk["limit_bytes"] == 2 * MiB
        assert c.stats(namespace=other)["namespace"]["disk_chunks"] >= 16


def sample_value(text: str, name: str, **labels: str) -> float | None:
    import re

    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.startswith(name + "{") and dict(re.findall(r'(\w+)="([^"]*)"', head[len(name) :])) == labels:
            return float(value)
    return None
