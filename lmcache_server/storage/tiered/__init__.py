"""The tiered store: one store over the tiers, fastest first (memory, then disk, then Redis).

Its face is :class:`TieredStore` (``store``), a facade that builds and holds its
parts, one job per module:

- ``roles``: the roles its tiers play, as the interfaces it holds (memory, a
  spill target, an uplink) and the record of one store's tiers;
- ``writes``: the two-phase put and its variants; ``filling``: the fills of
  answered puts (copies into the pool off the event loop);
- ``reads``: gets, each lower tier read for the whole batch at once;
- ``lookups``: which tier holds each key;
- ``promotion``: copies of lower-tier chunks into memory (gets and prefetches);
- ``uplink``: what is stored, queued for Redis; ``spill``: what memory evicts,
  to the disk;
- ``gate``: the tier gate, which chunks the disk and Redis take;
- ``residence``: what the KV-event announcer and the gate are told as chunks
  arrive and leave;
- ``upkeep``: delete, clear, pin, unpin; ``stats``: the store's figures.

It imports the tiers' packages (``memory``, ``disk``, ``remote``: their faces
only) and the storage leaves.  A new lower tier is a subpackage of ``storage``
playing one of the roles, plus its place in :class:`.roles.Tiers`.
"""

from .gate import MODES, StoreGate, TierGate, sketch_width_for
from .roles import Memory, SpillTarget, Tiers, Uplink
from .store import TieredStore
from .writes import ROOM_WAIT_S

__all__ = [
    "MODES",
    "ROOM_WAIT_S",
    "Memory",
    "SpillTarget",
    "StoreGate",
    "TierGate",
    "TieredStore",
    "Tiers",
    "Uplink",
    "sketch_width_for",
]
