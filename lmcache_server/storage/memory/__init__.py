"""The memory tier and what it stands on: the pool, its allocator, warm restarts.

- ``pool``: the shared-memory segment (:class:`MemoryPool`), pinned when it can be;
- ``allocator``: best-fit extents of ``ALIGNMENT`` bytes inside it
  (``extent_of(size)``: the bytes a chunk of ``size`` holds in the pool, what
  quotas and pins charge);
- ``entry``: the compact per-chunk record (offset and size packed in one int);
- ``tier``: :class:`MemoryTier`, the chunks in the pool: reads, reservations
  (the two-phase write), pins; built on ``eviction`` (allocation, eviction,
  quotas) on ``index`` (the tier's state, entries, leases, removal, accounts);
- ``warm``, ``warmstart``, ``warmindex``, ``warmadopt`` and ``installation``: the
  pool handed from a cleanly stopped daemon to the next (the tier's side; finding,
  locking and writing in ``shm_dir``; the index file and its checks; its adoption;
  who wrote it: this installation, this boot).

It imports the storage leaves and :mod:`..policy`, never the disk or Redis tier.
Code outside this room imports the names below from ``storage.memory``.
"""

from .allocator import ALIGNMENT, extent_of
from .entry import UNBOUND, Reservation
from .index import PinRoom
from .installation import installation_id
from .pool import MemoryPool, PinningError, remove_stale_segments
from .tier import MemoryTier
from .warmadopt import Adoption
from .warmindex import HeldLease, HeldSlot
from .warmstart import KeptSegment, WarmStart

__all__ = [
    "ALIGNMENT",
    "UNBOUND",
    "Adoption",
    "HeldLease",
    "HeldSlot",
    "KeptSegment",
    "MemoryPool",
    "MemoryTier",
    "PinRoom",
    "PinningError",
    "Reservation",
    "WarmStart",
    "extent_of",
    "installation_id",
    "remove_stale_segments",
]
