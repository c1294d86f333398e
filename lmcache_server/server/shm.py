"""Leases of the shared-memory data path: chunks a local client reads from, or
writes into, the pool it has mapped.

A local client maps the pool segment the hello reply names (see
storage/pool.py).  Then:

- **get** with ``shm``: the reply carries each hit's ``(offset, length)`` in
  the pool and a *read lease*: the chunks stay leased (never evicted, never
  overwritten, a delete frees them only afterwards) until the client sends
  ``release`` or the lease expires.
- **alloc**: room for each chunk, reserved in the pool and invisible to
  readers, under a *write lease*; the client copies its bytes in and sends
  ``commit`` (the chunks become visible) or ``release`` (abandoned).

Every lease expires ``timeout_s`` after it was granted, so a client that
crashed cannot pin memory forever (counted).  The grant carries its deadline
in CLOCK_MONOTONIC seconds: a client on this host reads the same clock, and a
copy it finished before the deadline was made under a live lease.  An expired
write reservation is not reused at once: it is quarantined for another
``timeout_s`` first, so a client that overran its deadline cannot scribble on
another chunk's bytes.

Lease ids are random 63-bit numbers: a client cannot guess another's.

Primitives: :class:`ShmLeases` (``offer``, ``check_segment``, ``grant_reads``,
``grant_writes``, ``commit``, ``release``, ``sweep``, ``run``, ``stats``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import Sequence
from typing import Any

from lmcache_client.protocol import ErrorCode, ProtocolError, PutStatus

from ..storage import Chunk, TieredStore
from ..storage.memory import Reservation
from ..storage.pool import MemoryPool


@dataclasses.dataclass(slots=True, eq=False)
class _ReadLease:
    chunks: list[Chunk]
    deadline: float
    nbytes: int


@dataclasses.dataclass(slots=True, eq=False)
class _WriteLease:
    reservations: list[Reservation]
    deadline: float
    nbytes: int


@dataclasses.dataclass
class ShmCounters:
    read_leases: int = 0
    write_leases: int = 0
    read_bytes: int = 0
    committed_bytes: int = 0
    expired_reads: int = 0
    expired_writes: int = 0
    aborted_writes: int = 0


class ShmLeases:
    def __init__(self, store: TieredStore, pool: MemoryPool, timeout_s: float):
        self.store = store
        self.pool = pool
        self.timeout_s = timeout_s
        self.counters = ShmCounters()
        self._reads: dict[int, _ReadLease] = {}
        self._writes: dict[int, _WriteLease] = {}
        self._quarantine: list[tuple[float, list[Reservation]]] = []

    @property
    def enabled(self) -> bool:
        return self.pool.shared

    def offer(self) -> dict[str, Any] | None:
        """What the hello reply tells a client about mapping the pool (None: not shared)."""
        if self.pool.shm_path is None:
            return None
        return {
            "path": str(self.pool.shm_path),
            "size": self.pool.size,
            "segment": self.pool.shm_token,
            "lease_timeout_s": self.timeout_s,
            "clock": time.monotonic(),
        }

    def check_segment(self, segment: Any, request_id: int) -> None:
        """Refuse a request naming a segment that is not this pool's (the daemon restarted)."""
        if not self.enabled:
            raise ProtocolError(ErrorCode.STALE_SEGMENT, "shared memory is off on this server", request_id)
        if segment != self.pool.shm_token:
            raise ProtocolError(
                ErrorCode.STALE_SEGMENT, "unknown shared-memory segment: say hello again and remap", request_id
            )

    def _new_id(self) -> int:
        while True:
            lease = secrets.randbits(63)
            if lease and lease not in self._reads and lease not in self._writes:
                return lease

    # -- grants --------------------------------------------------------------------
    def grant_reads(self, chunks: Sequence[Chunk]) -> tuple[int, float]:
        """Keep ``chunks`` (memory-tier, leased) until released or expired: (lease id, deadline)."""
        deadline = time.monotonic() + self.timeout_s
        lease = self._new_id()
        nbytes = sum(c.nbytes for c in chunks)
        self._reads[lease] = _ReadLease(list(chunks), deadline, nbytes)
        self.counters.read_leases += 1
        self.counters.read_bytes += nbytes
        return lease, deadline

    def grant_writes(self, reservations: Sequence[Reservation]) -> tuple[int, float]:
        deadline = time.monotonic() + self.timeout_s
        lease = self._new_id()
        self._writes[lease] = _WriteLease(list(reservations), deadline, sum(r.size for r in reservations))
        self.counters.write_leases += 1
        return lease, deadline

    # -- ends ----------------------------------------------------------------------
    def commit(self, lease: Any, request_id: int) -> tuple[list[PutStatus], int]:
        """Make a write lease's chunks visible, in the order they were allocated:
        (one status per chunk, the bytes committed)."""
        grant = self._writes.pop(lease, None) if isinstance(lease, int) else None
        if grant is None:
            raise ProtocolError(
                ErrorCode.UNKNOWN_LEASE, f"no write lease {lease!r} (expired or never granted)", request_id
            )
        if time.monotonic() > grant.deadline:
            self._expire_writes(grant)
            raise ProtocolError(ErrorCode.UNKNOWN_LEASE, f"write lease {lease!r} expired", request_id)
        self.counters.committed_bytes += grant.nbytes
        return [self.store.commit(r) for r in grant.reservations], grant.nbytes

    def release(self, leases: Sequence[Any]) -> list[bool]:
        """End read leases (and abandon write leases); False for one unknown or expired."""
        now = time.monotonic()
        out = []
        for lease in leases:
            if not isinstance(lease, int):
                out.append(False)
                continue
            read = self._reads.pop(lease, None)
            if read is not None:
                for chunk in read.chunks:
                    chunk.release()
                # A release after the deadline is late: the client's copy may be torn.
                late = now > read.deadline
                if late:
                    self.counters.expired_reads += 1
                out.append(not late)
                continue
            write = self._writes.pop(lease, None)
            if write is not None:
                for reservation in write.reservations:
                    self.store.abort(reservation)
                self.counters.aborted_writes += 1
                out.append(now <= write.deadline)
                continue
            out.append(False)
        return out

    # -- expiry --------------------------------------------------------------------
    def sweep(self, now: float | None = None) -> int:
        """Expire leases past their deadline; returns how many."""
        now = time.monotonic() if now is None else now
        expired = 0
        for lease, read in list(self._reads.items()):
            if now > read.deadline:
                del self._reads[lease]
                for chunk in read.chunks:
                    chunk.release()
                self.counters.expired_reads += 1
                expired += 1
        for lease, write in list(self._writes.items()):
            if now > write.deadline:
                del self._writes[lease]
                self._expire_writes(write)
                expired += 1
        if self._quarantine:
            keep = []
            for until, reservations in self._quarantine:
                if now > until:
                    for reservation in reservations:
                        self.store.abort(reservation)
                else:
                    keep.append((until, reservations))
            self._quarantine = keep
        return expired

    def _expire_writes(self, write: _WriteLease) -> None:
        self.counters.expired_writes += 1
        self._quarantine.append((time.monotonic() + self.timeout_s, write.reservations))

    async def run(self) -> None:
        """Sweep until cancelled (a few times per lease timeout)."""
        interval = min(1.0, max(0.05, self.timeout_s / 4))
        while True:
            await asyncio.sleep(interval)
            self.sweep()

    def close(self) -> None:
        """Release every lease (shutdown)."""
        self.release(list(self._reads) + list(self._writes))
        for _, reservations in self._quarantine:
            for reservation in reservations:
                self.store.abort(reservation)
        self._quarantine.clear()

    def stats(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "active_read_leases": len(self._reads),
            "active_write_leases": len(self._writes),
            "leased_bytes": sum(r.nbytes for r in self._reads.values()),
            "reserved_bytes": sum(w.nbytes for w in self._writes.values())
            + sum(r.size for _, rs in self._quarantine for r in rs),
            **dataclasses.asdict(self.counters),
        }
