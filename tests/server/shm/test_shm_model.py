"""A model-based test of the shared-memory lease state machine (issue 29, Also).

Hypothesis drives one daemon's real in-process classes (server/shm/
ShmLeases over a TieredStore, MemoryTier and MemoryPool; a warm restart is
``hand_over``, the index through its file format, ``Adoption.restore`` and
``take_over`` into a new tier over the same pool) with the steps of clients
and of time: put, shm get (a read lease, a key possibly named twice), alloc,
the client's copy, commit, stage, bind, a bind whose restaging fails (issue
29 item 6), release, delete, the clock passing a lease deadline and the
sweep, a warm restart.  The client side is a model of a well-behaved client:
it writes only into slots it was granted and has not ended, only while its
lease is alive or, stalled past its deadline, while its process (an
observable, live owner) is known to the daemon and its quarantine lasts.

Found by it: issue 29 item 1 (put K; get [K, K]; delete K; warm restart;
warm restart: the extent freed twice) and item 6 (stage; a bind whose
restaging fails: the chunk's extent stays on the lease).

After every step: no pool extent is owned twice (by two live chunks, a chunk
and a write slot, two write slots, or a chunk deleted while leased and
anything else), no owned extent is free in the allocator and no allocated
byte is unowned; every readable chunk, and every chunk a read lease holds,
reads its own key's bytes.

The run is bounded and deterministic (``derandomize``, no example database).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Coroutine
from typing import Any, TypeVar
from unittest import mock

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from lmcache_client.protocol import ProtocolError, PutStatus
from lmcache_server.server.shm import QUARANTINE_FACTOR
from lmcache_server.storage.offload import Offload

from ._shm_model_support import (
    NS,
    TIMEOUT_S,
    Daemon,
    FakeClock,
    alive_owner,
    check_bytes,
    check_extents,
    dead_owner,
    digest,
    new_pool,
    shm_module,
    size_of,
    value,
)

T = TypeVar("T")
KEYS = 4
OWNERS = {"none": lambda: None, "alive": alive_owner, "dead": dead_owner}

keys = st.integers(0, KEYS - 1)
pick = st.integers(0, 1 << 16)


@dataclasses.dataclass
class Slot:
    size: int
    key: int | None
    """The key whose bytes the client copied in (None: nothing yet)."""


@dataclasses.dataclass
class Writer:
    """A write lease as its client sees it."""

    slots: dict[int, Slot]
    deadline: float
    owner: str
    staged: bool


class ShmModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.loop = asyncio.new_event_loop()
        self.offload = Offload(1)
        self.daemon = Daemon(new_pool())
        self.reads: dict[int, list[int]] = {}
        self.writes: dict[int, Writer] = {}

    def teardown(self) -> None:
        self.offload.close()
        self.loop.close()
        self.daemon.pool.close()  # every daemon of the run shares it

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    # -- the client's view -----------------------------------------------------
    def _may_write(self, w: Writer) -> bool:
        """Whether the client may still copy into its slots: its lease is alive, or
        its process is alive (a stalled writer the daemon keeps quarantined, for
        at most QUARANTINE_FACTOR lease timeouts: issue 29 item 3).  A
        "dead" owner wrote only at its grant: the daemon may free its slots at
        any sweep or warm restart, as its process is gone."""
        if w.owner == "dead":
            return False
        if w.owner == "alive":
            return self.clock.now <= w.deadline + QUARANTINE_FACTOR * TIMEOUT_S
        return self.clock.now <= w.deadline

    def _copy(self, offset: int, slot: Slot) -> None:
        view = self.daemon.pool.view
        data = value(slot.key) if slot.key is not None else b"\xee" * slot.size
        view[offset : offset + slot.size] = data

    @staticmethod
    def _choose(leases: dict[int, object], n: int) -> int:
        return list(leases)[n % len(leases)]  # in grant order: lease ids are random

    # -- rules -----------------------------------------------------------------
    @rule(k=keys)
    def put(self, k: int) -> None:
        statuses = self.run(self.daemon.store.put_many(NS, [digest(k)], [value(k)]))
        assert statuses[0] in (PutStatus.STORED, PutStatus.EXISTS, PutStatus.NO_SPACE)

    @rule(ks=st.lists(keys, min_size=1, max_size=3))
    def get_shm(self, ks: list[int]) -> None:
        chunks = self.run(self.daemon.store.get_many(NS, [digest(k) for k in ks]))
        hits = [(k, c) for k, c in zip(ks, chunks) if c is not None]
        for k, c in hits:
            assert c.offset is not None and bytes(c.data) == value(k)
        if hits:
            lease, _ = self.daemon.shm.grant_reads([c for _, c in hits])
            self.reads[lease] = [k for k, _ in hits]

    @rule(ks=st.lists(keys, min_size=1, max_size=3), owner=st.sampled_from(sorted(OWNERS)))
    def alloc(self, ks: list[int], owner: str) -> None:
        outcomes = self.daemon.store.reserve(NS, [digest(k) for k in ks], [size_of(k) for k in ks])
        granted = [(k, r) for k, r in zip(ks, outcomes) if not isinstance(r, PutStatus)]
        if not granted:
            return
        lease, deadline = self.daemon.shm.grant_writes([r for _, r in granted], OWNERS[owner]())
        w = Writer({r.offset: Slot(r.size, k) for k, r in granted}, deadline, owner, staged=False)
        for offset, slot in w.slots.items():
            self._copy(offset, slot)
        self.writes[lease] = w

    @rule(ks=st.lists(keys, min_size=1, max_size=2), owner=st.sampled_from(sorted(OWNERS)))
    def stage(self, ks: list[int], owner: str) -> None:
        staged = self.daemon.shm.stage([size_of(k) for k in ks], OWNERS[owner]())
        if staged is None:
            return
        lease, rooms, deadline = staged
        self.writes[lease] = Writer({r.offset: Slot(r.size, None) for r in rooms}, deadline, owner, staged=True)

    @precondition(lambda self: self.writes)
    @rule(n=pick)
    def copy_again(self, n: int) -> None:
        """A client (late, stalled) copies its bytes again into the slots it holds."""
        w = self.writes[self._choose(self.writes, n)]  # type: ignore[arg-type]
        if self._may_write(w):
            for offset, slot in w.slots.items():
                self._copy(offset, slot)

    @precondition(lambda self: any(not w.staged for w in self.writes.values()))
    @rule(n=pick)
    def commit(self, n: int) -> None:
        plain = {lease: w for lease, w in self.writes.items() if not w.staged}
        lease = self._choose(plain, n)  # type: ignore[arg-type]
        del self.writes[lease]
        try:
            statuses, _ = self.daemon.shm.commit(lease, 0)
        except ProtocolError:
            return
        assert all(s in (PutStatus.STORED, PutStatus.EXISTS) for s in statuses)

    @precondition(lambda self: any(w.staged for w in self.writes.values()))
    @rule(n=pick, k=keys)
    def bind(self, n: int, k: int) -> None:
        staged = {lease: w for lease, w in self.writes.items() if w.staged}
        lease = self._choose(staged, n)  # type: ignore[arg-type]
        w = self.writes[lease]
        fits = [o for o, s in sorted(w.slots.items()) if s.size == size_of(k)]
        if not fits or w.owner == "dead":  # a process that is gone sends no bind
            return
        offset = fits[0]
        if self._may_write(w):
            w.slots[offset].key = k
            self._copy(offset, w.slots[offset])
        try:
            statuses, fresh, deadline, _ = self.daemon.shm.bind(lease, NS, [digest(k)], [offset], None, 0)
        except ProtocolError:
            del self.writes[lease]  # expired or unknown: the daemon freed (or keeps) the slots, not ours now
            return
        w.deadline = deadline
        if statuses[0] is PutStatus.STORED:
            del w.slots[offset]
            for r in fresh:
                w.slots[r.offset] = Slot(r.size, None)

    @precondition(lambda self: any(w.staged for w in self.writes.values()))
    @rule(n=pick, k=keys)
    def bind_with_a_fault(self, n: int, k: int) -> None:
        """A bind whose restaging of a fresh slot fails (issue 29 item 6): the
        request errs; the client, not told what was consumed, gives the lease back."""
        staged = {lease: w for lease, w in self.writes.items() if w.staged}
        lease = self._choose(staged, n)  # type: ignore[arg-type]
        w = self.writes[lease]
        fits = [o for o, s in sorted(w.slots.items()) if s.size == size_of(k)]
        if not fits or not self._may_write(w):
            return
        offset = fits[0]
        w.slots[offset].key = k
        self._copy(offset, w.slots[offset])
        del self.writes[lease]

        def broken(sizes: object) -> None:
            raise RuntimeError("planted: restaging failed")

        with mock.patch.object(self.daemon.store, "stage", broken):
            try:
                self.daemon.shm.bind(lease, NS, [digest(k)], [offset], None, 0)
            except (RuntimeError, ProtocolError):
                pass
        check_extents(self.daemon)  # the lease table right after the fault, before the release
        self.daemon.shm.release([lease])

    @precondition(lambda self: self.reads or self.writes)
    @rule(n=pick)
    def release(self, n: int) -> None:
        held: dict[int, object] = {**self.reads, **self.writes}
        lease = self._choose(held, n)
        self.reads.pop(lease, None)
        self.writes.pop(lease, None)
        self.daemon.shm.release([lease])

    @rule(k=keys)
    def delete(self, k: int) -> None:
        self.run(self.daemon.store.delete(NS, [digest(k)]))

    @rule(dt=st.sampled_from([0.3 * TIMEOUT_S, 1.1 * TIMEOUT_S, (QUARANTINE_FACTOR + 1.1) * TIMEOUT_S]))
    def time_passes(self, dt: float) -> None:
        self.clock.now += dt
        self.daemon.shm.sweep()

    @rule()
    def warm_restart(self) -> None:
        self.daemon = self.daemon.warm_restart(self.clock)
        # A write in flight across a restart is aborted: its commit or bind is refused.

    # -- invariants --------------------------------------------------------------
    @invariant()
    def no_extent_owned_twice(self) -> None:
        check_extents(self.daemon)

    @invariant()
    def every_chunk_reads_its_own_bytes(self) -> None:
        check_bytes(self.daemon, self.reads)


def test_the_shm_lease_state_machine_keeps_extents_and_bytes() -> None:
    clock = FakeClock()

    class Machine(ShmModel):
        def __init__(self) -> None:
            super().__init__()
            self.clock = clock
            clock.now = 1000.0

    with mock.patch.object(shm_module, "time", clock):
        run_state_machine_as_test(
            Machine,
            settings=settings(
                max_examples=int(os.environ.get("SHM_MODEL_EXAMPLES", "800")),
                stateful_step_count=40,
                derandomize=True,
                database=None,
                deadline=None,
                suppress_health_check=list(HealthCheck),
            ),
        )


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
