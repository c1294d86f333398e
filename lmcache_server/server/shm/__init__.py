"""The daemon's side of the same-host shared-memory path: clients on this host map
the pool segment and read and write chunks in place, under leases.

- leases.py: :class:`ShmLeases`, which grants, ends and expires the read and
  write leases (and staged slots) of the pool, and holds
- table.py: :class:`.table.LeaseTable`, the leases, the quarantine of expired
  write slots, the nonces and the counters;
- ops.py: :class:`ShmOps`, the shared-memory ops (get under a read lease,
  alloc, commit, bind, release) that :class:`..handlers.Handlers` hands them to;
- warm.py: the leases across a warm restart (``hand_over``/``take_over``).

The face: :class:`ShmLeases` (built by app.py), :class:`ShmOps`,
:data:`QUARANTINE_FACTOR`, :data:`STAGED_SHARE`.
"""

from .leases import ShmLeases
from .ops import STAGED_SHARE, ShmOps
from .table import QUARANTINE_FACTOR

__all__ = ["QUARANTINE_FACTOR", "STAGED_SHARE", "ShmLeases", "ShmOps"]
