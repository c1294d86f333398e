"""The shared-memory leases across a warm restart (storage/memory/warmstart.py).

A warm restart keeps the segment, its token and the lease rules of
leases.py: at the clean stop :meth:`.leases.ShmLeases.hand_over` lists the
leases alive (:func:`held_leases`: the form the warm index stores), and the
next daemon's :meth:`.leases.ShmLeases.take_over` adopts them
(:func:`adopted_leases`): read leases keep their chunks until their deadline,
and every write slot, expired or not, goes straight into the quarantine under
its lease id.  Its writer's ``commit`` is refused (``UNKNOWN_LEASE``: a write
in flight across a restart is aborted) and frees the slot, as its ``release``
or its death does; a writer the daemon cannot observe gets
``QUARANTINE_FACTOR`` timeouts, counted from the lease's deadline.

Primitives: :func:`held_leases`, :func:`adopted_leases`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from ...storage import Chunk
from ...storage.memory import UNBOUND, HeldLease, HeldSlot, Reservation
from .table import Owner, Quarantined, ReadLease, WriteLease


def held_leases(
    reads: Mapping[int, ReadLease], writes: Mapping[int, WriteLease], quarantine: Mapping[int, Quarantined]
) -> list[HeldLease]:
    """The leases of a table, for the next daemon: read leases with their deadline,
    write leases (live ones since their deadline, quarantined ones since their
    quarantine began) with their owner and slots."""
    out = [
        HeldLease(
            lease,
            False,
            r.deadline,
            None,
            tuple(HeldSlot(c.offset, c.nbytes) for c in r.chunks if c.offset is not None),
        )
        for lease, r in reads.items()
    ]
    held = [(lease, w, w.deadline) for lease, w in writes.items()]
    held += [(lease, q.write, q.since) for lease, q in quarantine.items()]
    for lease, w, since in held:
        owner = dataclasses.asdict(w.owner) if w.owner is not None else None
        slots = tuple(HeldSlot(r.offset, r.size, None if r.key == UNBOUND else r.key) for r in w.reservations)
        out.append(HeldLease(lease, True, since, owner, slots))
    return out


def adopted_leases(
    reads: Sequence[tuple[int, float, list[Chunk]]],
    writes: Sequence[tuple[int, float, dict[str, int] | None, list[Reservation]]],
) -> tuple[dict[int, ReadLease], dict[int, Quarantined]]:
    """The leases of the daemon before a warm restart, as records: read leases
    ``(lease, deadline, chunks)`` held until they end, write slots ``(lease,
    since, owner, reservations)`` quarantined since ``since``."""
    adopted: dict[int, ReadLease] = {}
    quarantined: dict[int, Quarantined] = {}
    for lease, deadline, chunks in reads:
        adopted[lease] = ReadLease(list(chunks), deadline, sum(c.nbytes for c in chunks))
    for lease, since, owner, reservations in writes:
        nbytes = sum(r.size for r in reservations)
        write = WriteLease(list(reservations), since, nbytes, Owner.parse(owner))
        quarantined[lease] = Quarantined(lease, write, since)
    return adopted, quarantined
