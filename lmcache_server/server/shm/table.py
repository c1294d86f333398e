"""The shared-memory lease table (leases.py grants, ends and expires its leases).

A read lease holds chunks, a write lease holds reservations (pool room, bound
to a key by its alloc, or to none when staged), and an expired write lease
waits in the quarantine until its writer is known to be done: the writer is
the :class:`Owner` its alloc named (alive: the same process still exists, read
from ``/proc``), and ``QUARANTINE_FACTOR`` lease timeouts bound every
quarantine.  :class:`LeaseTable` holds them all, with the nonces of allocs,
and says what they hold (``reserved_bytes``, ``stats``); :class:`ShmCounters`
counts what the table did.

Primitives: :class:`LeaseTable`, :class:`ReadLease`, :class:`WriteLease`,
:class:`Quarantined`, :class:`Owner`, :class:`ShmCounters`, :data:`QUARANTINE_FACTOR`.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from typing import Any

from ...storage import Chunk, TieredStore
from ...storage.memory import Reservation


@dataclasses.dataclass(slots=True, eq=False)
class ReadLease:
    chunks: list[Chunk]
    deadline: float
    nbytes: int


@dataclasses.dataclass(slots=True, eq=False)
class WriteLease:
    reservations: list[Reservation]
    deadline: float
    nbytes: int
    owner: Owner | None = None
    staged: bool = False
    """Slots bound to no key yet (a commit's ``stage``), consumed by ``bind``."""
    tenant: str | None = None
    """The tenant whose alloc made it (its reservations are charged to it)."""


QUARANTINE_FACTOR = 20
"""Lease timeouts an expired write slot of a writer the daemon cannot observe stays
quarantined (with the default 30 s: 10 minutes)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Owner:
    """The process holding a write lease, as its alloc described it."""

    pid: int
    pidns: int
    start: int
    """Process start time (clock ticks since boot, /proc/<pid>/stat field 22)."""

    @classmethod
    def parse(cls, value: Any) -> Owner | None:
        if not isinstance(value, dict):
            return None
        try:
            owner = cls(int(value["pid"]), int(value["pidns"]), int(value["start"]))
        except (KeyError, TypeError, ValueError):
            return None
        return owner if owner.pid > 0 else None

    def observable(self) -> bool:
        """Whether this daemon sees the owner's pid namespace (so its pid means the same here)."""
        return _own_pidns() == self.pidns

    def alive(self) -> bool:
        """The process still exists (the same one: a reused pid has another start time)."""
        return _start_time(self.pid) == self.start


def _own_pidns() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


@dataclasses.dataclass(slots=True, eq=False)
class Quarantined:
    lease: int
    write: WriteLease
    since: float


@dataclasses.dataclass
class ShmCounters:
    read_leases: int = 0
    write_leases: int = 0
    read_bytes: int = 0
    committed_bytes: int = 0
    expired_reads: int = 0
    expired_writes: int = 0
    aborted_writes: int = 0
    quarantine_released: int = 0
    """Expired write slots freed because their writer came back (commit/release) or died."""
    quarantine_timed_out: int = 0
    """Expired write slots of unobservable writers freed after QUARANTINE_FACTOR timeouts."""
    staged_leases: int = 0
    """Leases of staged slots granted (a commit's ``stage``)."""
    binds: int = 0
    """Puts into staged slots (``bind`` requests answered)."""
    expired_staged: int = 0
    """Leases of staged slots that lapsed (quarantined like an expired write lease)."""


class LeaseTable:
    """The leases of one pool: read leases, write leases, the quarantine and the
    nonces, with what they hold; :class:`.leases.ShmLeases` grants and ends them."""

    def __init__(self, store: TieredStore):
        self.store = store
        """Where an abandoned write slot goes back (``abort``)."""
        self.counters = ShmCounters()
        self.reads: dict[int, ReadLease] = {}
        self.writes: dict[int, WriteLease] = {}
        self.quarantine: dict[int, Quarantined] = {}
        self.nonces: dict[int, int] = {}
        """Client-chosen nonce of a live write lease -> its lease id."""
        self.cancelled: dict[int, float] = {}
        """Nonces released before any grant -> until when a late grant under them is refused."""

    def new_id(self) -> int:
        while True:
            lease = secrets.randbits(63)
            if lease and lease not in self.reads and lease not in self.writes:
                return lease

    def abort(self, write: WriteLease) -> None:
        for reservation in write.reservations:
            self.store.abort(reservation)

    def end_quarantine(self, lease: int) -> bool:
        held = self.quarantine.pop(lease, None)
        if held is None:
            return False
        self.abort(held.write)
        self.counters.quarantine_released += 1
        return True

    def reserved_bytes(self) -> int:
        """Pool bytes write leases hold now (staged slots and quarantined slots included)."""
        return sum(w.nbytes for w in self.writes.values()) + sum(q.write.nbytes for q in self.quarantine.values())

    def tenant_reserved_bytes(self, tenant: str) -> int:
        """Pool bytes the write leases of ``tenant``'s allocs hold now (quarantined ones included)."""
        held = [w for w in self.writes.values()] + [q.write for q in self.quarantine.values()]
        return sum(w.nbytes for w in held if w.tenant == tenant)

    def staged_bytes(self) -> int:
        """Pool bytes held by staged slots now (not counting quarantined ones)."""
        return sum(w.nbytes for w in self.writes.values() if w.staged)

    def stats(self) -> dict[str, Any]:
        """What the leases hold now, and the counters (the front adds ``enabled``)."""
        return {
            "active_read_leases": len(self.reads),
            "active_write_leases": sum(1 for w in self.writes.values() if not w.staged),
            "leased_bytes": sum(r.nbytes for r in self.reads.values()),
            "reserved_bytes": self.reserved_bytes(),
            "quarantined_bytes": sum(q.write.nbytes for q in self.quarantine.values()),
            "active_staged_leases": sum(1 for w in self.writes.values() if w.staged),
            "staged_bytes": self.staged_bytes(),
            **dataclasses.asdict(self.counters),
        }
