"""Leases of the shared-memory data path: chunks a local client reads from, or
writes into, the pool it has mapped.

A local client maps the pool segment the hello reply names (see
storage/memory/pool.py).  Then:

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
copy it finished before the deadline was made under a live lease.

A committed chunk never changes, so an expired write reservation is never
handed to another chunk while its writer might still copy into it (a client
stalled mid-copy, e.g. stopped, that resumes later).  It stays quarantined
until its writer is known to be done:

- its ``commit`` or ``release`` for that lease arrives (refused, the lease has
  expired; but the writer sends it after its copy), or
- its process is gone: the alloc names the writer (``owner``: pid, pid
  namespace, process start time) and, when the writer is in the daemon's pid
  namespace, the sweep checks ``/proc/<pid>`` (a pid reused by another process
  has another start time);
- in any case ``QUARANTINE_FACTOR`` lease timeouts (10 minutes by default)
  after it began, a live writer's too (a grant its client never saw, or a
  client holding slots on purpose, must not hold the pool for ever): the one
  case where a writer stopped longer than that and then resumed could still
  write into a reused slot.  Put the engines in the daemon's pid namespace
  (compose: ``pid: "service:lmcache-server"``) so dead writers free theirs at once.

An alloc may carry a client-chosen ``nonce``: a ``release`` naming it frees
the grant made under it (:meth:`ShmLeases.release_nonces`), so a client whose
alloc reply never came frees a grant it never saw.  A bind takes each slot a
key consumed off its lease at once, whatever fails after (no committed
chunk's extent is ever left on a lease).

**Staged slots** (a put in one round trip): a commit may ask for pool room
bound to no key (:meth:`ShmLeases.stage`), held under a write lease of its
own; the client copies its next put into it and sends one ``bind``
(:meth:`ShmLeases.bind`), which binds each slot to its key with the checks
of an alloc, commits it, and stages a fresh slot in place of each consumed
one.  A staged lease is a write lease otherwise: counted as reserved,
expiring (renewed by each bind) into the quarantine, handed over at a warm
restart (its slots with no key), freed by release.

Lease ids are random 63-bit numbers: a client cannot guess another's.

A warm restart (storage/memory/warmstart.py) keeps the segment, its token and these
rules: :meth:`ShmLeases.hand_over` and :meth:`ShmLeases.take_over` carry the
leases to the next daemon (warm.py says how).  The table itself (its
records, the writer's liveness, what the leases hold, the counters) is the
:class:`.table.LeaseTable` that :class:`ShmLeases` builds and holds; this
module grants, ends and expires its leases.

Primitives: :class:`ShmLeases` (``offer``, ``check_segment``, ``grant_reads``,
``grant_writes``, ``stage``, ``bind``, ``commit``, ``release``, ``release_nonces``, ``sweep``,
``run``, ``stats``, ``reserved_bytes``, ``hand_over``, ``take_over``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from lmcache_client.protocol import ErrorCode, ProtocolError, PutStatus

from ...storage import Chunk, TieredStore
from ...storage.memory import HeldLease, MemoryPool, Reservation
from ...storage.tiered import ROOM_WAIT_S
from .table import QUARANTINE_FACTOR, LeaseTable, Owner, Quarantined, ReadLease, WriteLease
from .warm import adopted_leases, held_leases

MAX_CANCELLED = 65536
"""Nonces released before their grant remembered at most (each for a couple of lease timeouts)."""


class ShmLeases:
    """Grants, ends and expires the leases of the table it holds (see the module docstring)."""

    def __init__(self, store: TieredStore, pool: MemoryPool, timeout_s: float):
        self.store = store
        self.pool = pool
        self.timeout_s = timeout_s
        self.table = LeaseTable(store)
        """The leases, the quarantine, the nonces and the counters (table.py)."""

    @property
    def enabled(self) -> bool:
        return self.pool.shared

    # -- what the table holds (table.py) -------------------------------------------
    def reserved_bytes(self) -> int:
        return self.table.reserved_bytes()

    def tenant_reserved_bytes(self, tenant: str) -> int:
        return self.table.tenant_reserved_bytes(tenant)

    def staged_bytes(self) -> int:
        return self.table.staged_bytes()

    def stats(self) -> dict[str, Any]:
        return {"enabled": self.enabled, **self.table.stats()}

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

    # -- grants --------------------------------------------------------------------
    def grant_reads(self, chunks: Sequence[Chunk]) -> tuple[int, float]:
        """Keep ``chunks`` (memory-tier, leased) until released or expired: (lease id, deadline)."""
        t = self.table
        deadline = time.monotonic() + self.timeout_s
        lease = t.new_id()
        nbytes = sum(c.nbytes for c in chunks)
        t.reads[lease] = ReadLease(list(chunks), deadline, nbytes)
        t.counters.read_leases += 1
        t.counters.read_bytes += nbytes
        return lease, deadline

    def grant_writes(
        self,
        reservations: Sequence[Reservation],
        owner: Any = None,
        staged: bool = False,
        nonce: int | None = None,
        tenant: str | None = None,
    ) -> tuple[int, float]:
        """Reserve ``reservations`` for one writer (``owner``: its alloc's ``owner``
        field, see :class:`Owner`; ``staged``: slots bound to no key, see
        :meth:`stage`; ``nonce``: the alloc's client-chosen id, see
        :meth:`release_nonces`): (lease id, deadline).  A nonce already released
        (the client gave up waiting) or in use: the reservations are aborted and
        the grant refused (``UNKNOWN_LEASE``)."""
        t = self.table
        if nonce is not None and (nonce in t.cancelled or nonce in t.nonces):
            t.cancelled.pop(nonce, None)
            for reservation in reservations:
                self.store.abort(reservation)
            raise ProtocolError(ErrorCode.UNKNOWN_LEASE, f"alloc nonce {nonce!r} was released or is in use", 0)
        deadline = time.monotonic() + self.timeout_s
        lease = t.new_id()
        if nonce is not None:
            t.nonces[nonce] = lease
        t.writes[lease] = WriteLease(
            list(reservations), deadline, sum(r.size for r in reservations), Owner.parse(owner), staged, tenant
        )
        if staged:
            t.counters.staged_leases += 1
        else:
            t.counters.write_leases += 1
        return lease, deadline

    def stage(self, sizes: Sequence[int], owner: Any = None) -> tuple[int, list[Reservation], float] | None:
        """Staged slots of ``sizes`` (pool room bound to no key, see
        :meth:`bind`) under a new write lease: (lease id, slots, deadline), or
        None when the pool cannot hold them all now.  The lease ends, expires and
        is quarantined like any write lease."""
        rooms = self.store.stage(sizes)
        if rooms is None:
            return None
        lease, deadline = self.grant_writes(rooms, owner, staged=True)
        return lease, rooms, deadline

    def bind(
        self,
        lease: int,
        namespace: str,
        keys: Sequence[bytes],
        offsets: Sequence[int],
        tokens: Any,
        request_id: int,
    ) -> tuple[list[PutStatus], list[Reservation], float, int]:
        """A put into staged slots: the slot at ``offsets[i]`` (written by the client)
        is bound to ``keys[i]`` and committed at once, with the checks of an
        alloc (EXISTS, SKIPPED, tenant quota).  STORED consumes the slot and
        stages a fresh one of its size in its place (when the pool has room);
        any other status leaves it staged.  The lease's deadline is renewed.
        Returns (one status per key, the fresh slots, the deadline, bytes committed)."""
        t = self.table
        grant = t.writes.get(lease)
        if grant is None:
            if t.end_quarantine(lease):
                raise ProtocolError(ErrorCode.UNKNOWN_LEASE, f"staged lease {lease!r} expired", request_id)
            raise ProtocolError(
                ErrorCode.UNKNOWN_LEASE, f"no staged lease {lease!r} (expired or never granted)", request_id
            )
        if not grant.staged:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"lease {lease!r} holds no staged slots", request_id)
        at = {r.offset: r for r in grant.reservations}
        if not all(o in at for o in offsets):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, "'slots' names an offset that is no slot of this lease", request_id
            )
        if time.monotonic() > grant.deadline:
            # Late: refused; its writer is past its copy (one put at a time per lease), so its room is free now.
            del t.writes[lease]
            t.counters.expired_staged += 1
            t.abort(grant)
            raise ProtocolError(ErrorCode.UNKNOWN_LEASE, f"staged lease {lease!r} expired", request_id)
        rooms = [at[o] for o in offsets]
        # Each room a key took leaves the lease right away, whatever fails after:
        # a committed chunk's extent must never be released (or reused) as a slot.
        taken: list[Reservation] = []
        fresh: list[Reservation] = []
        try:
            statuses = self.store.bind(namespace, keys, rooms, tokens, taken)
            for room in taken:
                fresh += self.store.stage([room.size]) or []
        finally:
            for room in taken:
                at.pop(room.offset, None)
            grant.reservations = list(at.values()) + fresh
            grant.nbytes = sum(r.size for r in grant.reservations)
        grant.deadline = time.monotonic() + self.timeout_s
        nbytes = sum(r.size for r in taken)
        t.counters.committed_bytes += nbytes
        t.counters.binds += 1
        return statuses, fresh, grant.deadline, nbytes

    # -- ends ----------------------------------------------------------------------
    def commit(self, lease: Any, request_id: int) -> tuple[list[PutStatus], int]:
        """Make a write lease's chunks visible, in the order they were allocated:
        (one status per chunk, the bytes committed)."""
        t = self.table
        grant = t.writes.get(lease) if isinstance(lease, int) else None
        if grant is not None and grant.staged:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"lease {lease!r} holds staged slots: bind them", request_id)
        if grant is not None:
            del t.writes[lease]
        if grant is None:
            if isinstance(lease, int) and t.end_quarantine(lease):
                raise ProtocolError(ErrorCode.UNKNOWN_LEASE, f"write lease {lease!r} expired", request_id)
            raise ProtocolError(
                ErrorCode.UNKNOWN_LEASE, f"no write lease {lease!r} (expired or never granted)", request_id
            )
        if time.monotonic() > grant.deadline:
            # Late: refused, but its writer is past its copy, so its room is free now.
            t.counters.expired_writes += 1
            t.abort(grant)
            raise ProtocolError(ErrorCode.UNKNOWN_LEASE, f"write lease {lease!r} expired", request_id)
        t.counters.committed_bytes += grant.nbytes
        return [self.store.commit(r) for r in grant.reservations], grant.nbytes

    def release(self, leases: Sequence[Any]) -> list[bool]:
        """End read leases (and abandon write leases); False for one unknown or expired."""
        t = self.table
        now = time.monotonic()
        out = []
        for lease in leases:
            if not isinstance(lease, int):
                out.append(False)
                continue
            read = t.reads.pop(lease, None)
            if read is not None:
                for chunk in read.chunks:
                    chunk.release()
                # A release after the deadline is late: the client's copy may be torn.
                late = now > read.deadline
                if late:
                    t.counters.expired_reads += 1
                out.append(not late)
                continue
            write = t.writes.pop(lease, None)
            if write is not None:
                t.abort(write)
                t.counters.aborted_writes += 1
                out.append(now <= write.deadline)
                continue
            if t.end_quarantine(lease):  # a writer whose lease expired is done with it
                out.append(False)
                continue
            # An alloc's nonce (its client never saw the grant): see release_nonces.
            out.append(self.release_nonces([lease])[0])
        return out

    def release_nonces(self, nonces: Sequence[Any]) -> list[bool]:
        """Abandon the write leases granted under these client-chosen nonces (an
        alloc whose reply the client never saw); a nonce with no grant yet is
        remembered for a while so that its grant, if it comes, is refused.
        True where a live lease was released."""
        t = self.table
        now = time.monotonic()
        out = []
        for nonce in nonces:
            if type(nonce) is not int:
                out.append(False)
                continue
            lease = t.nonces.pop(nonce, None)
            if lease is not None and lease not in t.writes and lease not in t.quarantine:
                out.append(False)  # committed or released already
                continue
            if lease is None:
                if len(t.cancelled) < MAX_CANCELLED:
                    t.cancelled[nonce] = now + 2 * self.timeout_s + ROOM_WAIT_S
                out.append(False)
            else:
                out.append(self.release([lease])[0])
        return out

    # -- expiry --------------------------------------------------------------------
    def sweep(self, now: float | None = None) -> int:
        """Expire leases past their deadline; returns how many."""
        t = self.table
        now = time.monotonic() if now is None else now
        expired = 0
        for lease, read in list(t.reads.items()):
            if now > read.deadline:
                del t.reads[lease]
                for chunk in read.chunks:
                    chunk.release()
                t.counters.expired_reads += 1
                expired += 1
        for lease, write in list(t.writes.items()):
            if now > write.deadline:
                del t.writes[lease]
                if write.staged:
                    t.counters.expired_staged += 1
                else:
                    t.counters.expired_writes += 1
                t.quarantine[lease] = Quarantined(lease, write, now)
                expired += 1
        for nonce, lease in list(t.nonces.items()):
            if lease not in t.writes and lease not in t.quarantine:
                del t.nonces[nonce]
        for nonce, until in list(t.cancelled.items()):
            if now > until:
                del t.cancelled[nonce]
        for lease, held in list(t.quarantine.items()):
            owner = held.write.owner
            if owner is not None and owner.observable() and not owner.alive():
                t.end_quarantine(lease)
            elif now - held.since > QUARANTINE_FACTOR * self.timeout_s:
                # Every quarantine is bounded, a live owner's too: a writer that
                # never comes back must not hold the pool (and the reserve cap of ops.py) forever.
                del t.quarantine[lease]
                t.abort(held.write)
                t.counters.quarantine_timed_out += 1
        return expired

    async def run(self) -> None:
        """Sweep until cancelled (a few times per lease timeout)."""
        interval = min(1.0, max(0.05, self.timeout_s / 4))
        while True:
            await asyncio.sleep(interval)
            self.sweep()

    # -- warm restarts (warm.py) ---------------------------------------------------
    def hand_over(self) -> list[HeldLease]:
        """The leases alive now, for the next daemon (a clean stop); then :meth:`close`."""
        t = self.table
        out = held_leases(t.reads, t.writes, t.quarantine)
        self.close()
        return out

    def take_over(
        self,
        reads: Sequence[tuple[int, float, list[Chunk]]],
        writes: Sequence[tuple[int, float, dict[str, int] | None, list[Reservation]]],
    ) -> None:
        """Leases of the daemon before a warm restart: read leases ``(lease,
        deadline, chunks)`` held until they end, write slots ``(lease, since,
        owner, reservations)`` quarantined (see warm.py)."""
        t = self.table
        adopted, quarantined = adopted_leases(reads, writes)
        t.reads.update(adopted)
        t.quarantine.update(quarantined)

    def close(self) -> None:
        """Release every lease (shutdown)."""
        t = self.table
        self.release(list(t.reads) + list(t.writes))
        for held in t.quarantine.values():
            t.abort(held.write)
        t.quarantine.clear()
