"""Storage: the tier interface (base), the memory pool and its allocator, the
memory tier, and the tiered store that composes tiers."""

from .base import Chunk, ChunkKey, Tier
from .memory import MemoryTier
from .pool import MemoryPool, PinningError
from .tiered import TieredStore

__all__ = ["Chunk", "ChunkKey", "MemoryPool", "MemoryTier", "PinningError", "Tier", "TieredStore"]
