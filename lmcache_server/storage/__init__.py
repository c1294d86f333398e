"""Storage: the chunks the daemon keeps, in tiers composed by one store.

Rooms (each subpackage's docstring says what it owns):

- at the top, the tier interface (``base``: :class:`Tier`, :class:`Chunk`,
  :class:`ChunkKey`) and the leaves several tiers share: record files
  (``chunkfile``), copies off the event loop (``offload``), tenant quotas
  (``tenants``), the sizing telemetry's sketches (``sizing``), the private
  state directory and its files (``statefiles``);
- ``policy/``: eviction and admission policies;
- ``memory/``: the pool, its allocator, the memory tier and warm restarts;
- ``disk/``: the disk tier; ``remote/``: the Redis tier;
- ``tiered/``: the tiered store that ties the tiers together (its writes,
  batched reads, lookups, promotions and prefetches, spill, fills, and the tier
  gate: which chunks go below memory).

Layering, each floor importing only those below it, never a sibling:
leaves (base, chunkfile, offload, tenants, sizing, statefiles) <- policy <- memory, disk, remote
<- tiered.  Of the rest of ``lmcache_server`` storage
imports only ``config`` and ``supervisor``.  Code outside a room imports from
the room's package (``storage.disk``), not from its modules.
"""

from .base import Chunk, ChunkKey, Tier, TierLinks
from .memory import MemoryPool, MemoryTier, PinningError
from .tiered import TieredStore

__all__ = ["Chunk", "ChunkKey", "MemoryPool", "MemoryTier", "PinningError", "Tier", "TierLinks", "TieredStore"]
