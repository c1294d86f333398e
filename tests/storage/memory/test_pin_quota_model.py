"""A model-based test of pins and tenant quotas in the memory tier (issue 39, Also).

Hypothesis drives the real in-process classes (a TieredStore over a MemoryTier
over a MemoryPool, tenant quotas as app.py sets them) with the steps of
tenants: batched puts of chunks of 0 to 4096 bytes (every one a single 4 KiB
extent), pins and unpins, a flood of one-byte pins, gets, deletes, a store's reservation aborted (a
failed write), a staged room bound to a key, and warm restarts: the pool
adopted by a new tier from the snapshot, and once from the index an older
daemon left with every chunk pinned (its pins charged payload bytes).

Tenants: ``a`` (quota 8 pages), ``b`` (quota 12 pages), ``c`` (no quota) and
namespaces without a tenant, in a pool of 32 pages of which half may be
pinned (``max_pinned_fraction`` 0.5: each tenant with a quota may pin half of
it).

After every step, from the index's own entries: the pinned bytes, the pinned
bytes per namespace and per tenant and each tenant's used bytes equal the sum
of their chunks' extents; nothing is reserved between steps; the pins stay
within ``max_pinned_bytes`` and each tenant's share; each tenant holds at most
its quota.  Each step checks that no put is refused (``NO_SPACE``) while its
tenant's share is free (its quota less its pinned chunks and the chunks of
the same batch before it), and no pin while the pin room is free.

Before the fix of issue 39 item 3 (quotas and pins charged payload bytes)
tenant ``a`` pinned one-byte chunks until they filled the pool and ``c``'s
puts were refused.  The run is bounded and deterministic (``derandomize``).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from lmcache_client.protocol import PutStatus
from lmcache_server.storage import ChunkKey, MemoryPool, MemoryTier, TieredStore
from lmcache_server.storage.memory import Reservation, extent_of
from lmcache_server.storage.memory.entry import unpack
from lmcache_server.storage.policy import LRUPolicy
from lmcache_server.storage.tenants import TenantQuotas, tenant_of

from ...conftest import Closer

T = TypeVar("T")
PAGE = 4096
POOL_PAGES = 32
MAX_PINNED = POOL_PAGES * PAGE // 2
QUOTAS = {"a": 8 * PAGE, "b": 12 * PAGE}
SHARES = {t: q // 2 for t, q in QUOTAS.items()}  # max_pinned_fraction 0.5 of the quota
NAMESPACES = ["model|tenant=a", "model|tenant=b", "model|tenant=c", "model"]
KEYS = 12
SIZES = [0, 1, 100, PAGE - 1, PAGE]

namespaces = st.sampled_from(NAMESPACES)
keys = st.integers(0, KEYS - 1)
sizes = st.sampled_from(SIZES)


def digest(i: int, size: int) -> bytes:
    """Key ``i`` of a size: a key has one size, as a model's chunks have."""
    return hashlib.sha256(f"pin-quota-model-{i}-{size}".encode()).digest()


def new_tier(pool: MemoryPool) -> MemoryTier:
    return MemoryTier(pool, MAX_PINNED, LRUPolicy(), quotas=TenantQuotas(QUOTAS))  # as app.py builds it


def entries(tier: MemoryTier) -> list[tuple[ChunkKey, int, bool]]:
    """``(key, size, pinned)`` of every chunk the tier's index holds."""
    out = []
    for key, found in tier.index.entries.items():
        if isinstance(found, int):
            out.append((key, unpack(found)[1], False))
        else:
            out.append((key, found.size, found.pinned))
    return out


class PinQuotaModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.pool = MemoryPool(POOL_PAGES * PAGE, "off")
        self.memory = new_tier(self.pool)
        self.store = TieredStore(self.memory)

    def teardown(self) -> None:
        self.loop.close()
        self.pool.close()  # every tier of the run shares it

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    # -- what the index holds (the truth the accounts are checked against) ------
    def pinned_of(self, tenant: str | None) -> int:
        """Extents of the pinned chunks of ``tenant`` (None: of everyone)."""
        return sum(
            extent_of(size)
            for key, size, pinned in entries(self.memory)
            if pinned and (tenant is None or tenant_of(key.namespace) == tenant)
        )

    def pin_room(self, namespace: str) -> int:
        room = MAX_PINNED - self.pinned_of(None)
        tenant = tenant_of(namespace)
        if tenant in SHARES:
            room = min(room, SHARES[tenant] - self.pinned_of(tenant))
        return room

    # -- rules -----------------------------------------------------------------
    @rule(ns=namespaces, ks=st.lists(keys, min_size=1, max_size=4), size=sizes)
    def put(self, ns: str, ks: list[int], size: int) -> None:
        tenant = tenant_of(ns)
        pinned = self.pinned_of(tenant)
        digests = [digest(k, size) for k in ks]
        statuses = self.run(self.store.put_many(ns, digests, [os.urandom(size) for _ in ks]))
        before = 0  # chunks of this batch stored before each: reserved while it was checked
        for status in statuses:
            if status is PutStatus.NO_SPACE:
                # Refused only when its tenant's quota is held by pinned chunks and this batch.
                assert tenant in QUOTAS, f"a put of {ns} refused NO_SPACE: the pool's unpinned room was free"
                assert pinned + (before + 1) * PAGE > QUOTAS[tenant], (
                    f"a put of tenant {tenant} refused NO_SPACE while its share was free: "
                    f"{pinned} pinned, {before} stored in the batch, quota {QUOTAS[tenant]}"
                )
            else:
                assert status in (PutStatus.STORED, PutStatus.EXISTS), status
            before += status is PutStatus.STORED

    @rule(ns=namespaces, ks=st.lists(keys, min_size=1, max_size=4), size=sizes)
    def pin(self, ns: str, ks: list[int], size: int) -> None:
        for k in ks:
            key = ChunkKey(ns, digest(k, size))
            held = {e[0]: e for e in entries(self.memory)}.get(key)
            expected = held is not None and (held[2] or extent_of(held[1]) <= self.pin_room(ns))
            assert self.run(self.store.pin(ns, [key.digest])) == [expected]

    @rule(ns=namespaces)
    def pin_flood(self, ns: str) -> None:
        """Issue 39 item 3's attack: put every key as a one-byte chunk and pin it."""
        for k in range(KEYS):
            self.put(ns, [k], 1)
            self.pin(ns, [k], 1)

    @rule(ns=namespaces, ks=st.lists(keys, min_size=1, max_size=4), size=sizes)
    def unpin(self, ns: str, ks: list[int], size: int) -> None:
        self.run(self.store.unpin(ns, [digest(k, size) for k in ks]))

    @rule(ns=namespaces, k=keys, size=sizes)
    def get(self, ns: str, k: int, size: int) -> None:
        for chunk in self.run(self.store.get_many(ns, [digest(k, size)])):
            if chunk is not None:
                assert chunk.data.nbytes == size
                chunk.release()

    @rule(ns=namespaces, k=keys, size=sizes)
    def delete(self, ns: str, k: int, size: int) -> None:
        self.run(self.store.delete(ns, [digest(k, size)]))

    @rule(ns=namespaces, ks=st.lists(keys, min_size=1, max_size=4), size=sizes)
    def reserve_and_abort(self, ns: str, ks: list[int], size: int) -> None:
        """A write whose bytes never came: its room, and its quota charge, go back."""
        for r in self.store.reserve(ns, [digest(k, size) for k in ks], [size] * len(ks)):
            if isinstance(r, Reservation):
                self.memory.abort(r)

    @rule(ns=namespaces, k=keys, size=sizes, commit=st.booleans())
    def stage_and_bind(self, ns: str, k: int, size: int, commit: bool) -> None:
        """A staged shared-memory slot (room for no key yet) bound to a key, then committed or aborted."""
        room = self.memory.reserve_room(size)
        if room is None:
            return
        bound = self.memory.bind_room(room, ChunkKey(ns, digest(k, size)))
        if not isinstance(bound, Reservation):
            self.memory.abort(room)
        elif commit:
            self.memory.commit(bound)
        else:
            self.memory.abort(bound)

    @rule()
    def warm_restart(self) -> None:
        rows = self.memory.snapshot()
        self.memory = new_tier(self.pool)
        self.memory.adopt(rows, [])
        self.store = TieredStore(self.memory)

    @rule()
    def warm_restart_from_an_older_daemon(self) -> None:
        """The index of a daemon that charged payload bytes: every chunk pinned.
        The new tier pins what fits its bounds and adopts the rest unpinned."""
        rows = [(key, offset, size, True) for key, offset, size, _ in self.memory.snapshot()]
        self.memory = new_tier(self.pool)
        self.memory.adopt(rows, [])
        self.store = TieredStore(self.memory)
        for tenant, share in SHARES.items():
            assert self.pinned_of(tenant) <= share

    # -- invariants --------------------------------------------------------------
    @invariant()
    def accounts_are_the_sums_of_extents(self) -> None:
        tier = self.memory
        held = entries(tier)
        assert tier.pinned_bytes == sum(extent_of(s) for _, s, p in held if p)
        assert tier.allocator.allocated_bytes == sum(extent_of(s) for _, s, _ in held)
        assert tier.stored_bytes == sum(s for _, s, _ in held)
        for ns in NAMESPACES:
            mine = [(s, p) for k, s, p in held if k.namespace == ns]
            assert tier.pinned_in(ns) == (sum(p for _, p in mine), sum(extent_of(s) for s, p in mine if p))
        for tenant in QUOTAS:
            theirs = [(s, p) for k, s, p in held if tenant_of(k.namespace) == tenant]
            assert tier.quotas.used(tenant) == sum(extent_of(s) for s, _ in theirs)
            assert tier.quotas.pinned(tenant) == sum(extent_of(s) for s, p in theirs if p)
            assert tier.quotas.reserved(tenant) == 0

    @invariant()
    def pins_and_holdings_stay_within_their_bounds(self) -> None:
        tier = self.memory
        assert tier.pinned_bytes <= MAX_PINNED
        for tenant, quota in QUOTAS.items():
            assert tier.quotas.pinned(tenant) <= SHARES[tenant]
            assert tier.quotas.used(tenant) <= quota


def test_pins_and_quotas_charge_extents_and_leave_every_tenant_its_share() -> None:
    run_state_machine_as_test(
        PinQuotaModel,
        settings=settings(
            max_examples=int(os.environ.get("PIN_QUOTA_MODEL_EXAMPLES", "300")),
            stateful_step_count=40,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )


def test_an_older_daemons_pins_are_charged_by_extent_at_a_warm_restart(
    caplog: pytest.LogCaptureFixture, closed_at_end: Closer
) -> None:
    """The repro's pool left by a daemon before the fix: a tenant with a 1 MiB
    quota holding 16,384 pinned one-byte chunks, the whole 64 MiB.  The next
    daemon adopts them all, pins only its share (128 pages), and the rest is
    evictable: another tenant's put is stored, and the tenant's next put
    brings it back within its quota."""
    mib = 1 << 20
    pool = MemoryPool(64 * mib, "off")
    tier = closed_at_end(MemoryTier(pool, 32 * mib, LRUPolicy(), quotas=TenantQuotas({"acme": mib})))  # max_pinned 0.5
    acme = "model|tenant=acme"
    rows = [(ChunkKey(acme, digest(i, 1)), i * PAGE, 1, True) for i in range(16384)]
    tier.adopt(rows, [])
    assert tier.chunks == 16384 and tier.pinned_in(acme) == (128, 128 * PAGE)
    assert tier.quotas.pinned("acme") == tier.pinned_bytes == 128 * PAGE
    assert tier.quotas.used("acme") == 64 * mib  # adopted over its quota: evictable, not pinned
    assert "16256 chunks pinned before the restart were adopted unpinned" in caplog.text
    assert asyncio.run(tier.put(ChunkKey("model|tenant=other", b"o" * 32), b"o" * mib)) is PutStatus.STORED
    assert asyncio.run(tier.put(ChunkKey(acme, b"a" * 32), b"a")) is PutStatus.STORED
    assert tier.quotas.used("acme") == mib and tier.pinned_bytes == 128 * PAGE


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
