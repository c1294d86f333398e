"""The tiered store: the batch operations the server needs, over an ordered list of tiers.

Tiers are ordered fastest first (memory, then disk and Redis once built).
Reads fall through the tiers in order; writes go to the first tier (later
tiers are filled by spill and write-behind, issue #3).  Batching, lookup
semantics and accounting are written here once, not in each tier.

Primitives: ``get_many``, ``put_many``, ``lookup``, ``exists``, ``delete``,
``clear``, ``pin``, ``unpin``, ``stats``, ``close``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from lmcache_client.protocol import PutStatus

from .base import Chunk, ChunkKey, Tier
from .memory import MemoryTier


@dataclasses.dataclass
class LookupCounters:
    lookups: int = 0
    chunks_asked: int = 0
    chunks_hit: int = 0


class TieredStore:
    def __init__(self, memory: MemoryTier):
        self.memory = memory
        self.tiers: list[Tier] = [memory]
        self.lookup_counters = LookupCounters()

    async def get_many(self, namespace: str, digests: Sequence[bytes]) -> list[Chunk | None]:
        """One leased Chunk per hit (release each), None per miss."""
        out: list[Chunk | None] = []
        for digest in digests:
            key = ChunkKey(namespace, digest)
            chunk = None
            for tier in self.tiers:
                chunk = await tier.get(key)
                if chunk is not None:
                    break
            out.append(chunk)
        return out

    async def put_many(self, namespace: str, digests: Sequence[bytes], payloads: Sequence[Any]) -> list[PutStatus]:
        # Consecutive keys of one put are (nearly always) one prefix chain: the
        # previous key is a hint to the eviction policy.
        out = []
        parent: ChunkKey | None = None
        for digest, payload in zip(digests, payloads):
            key = ChunkKey(namespace, digest)
            out.append(await self.memory.put(key, payload, parent))
            parent = key
        return out

    async def lookup(self, namespace: str, digests: Sequence[bytes]) -> tuple[int, list[str | None]]:
        """Leading-hit count and the tier holding each key (None: not stored)."""
        tiers: list[str | None] = []
        for digest in digests:
            key = ChunkKey(namespace, digest)
            tiers.append(next((t.name for t in self.tiers if t.peek(key)), None))
        hits = next((i for i, t in enumerate(tiers) if t is None), len(tiers))
        c = self.lookup_counters
        c.lookups += 1
        c.chunks_asked += len(digests)
        c.chunks_hit += hits
        return hits, tiers

    async def exists(self, namespace: str, digests: Sequence[bytes]) -> list[bool]:
        return [any(t.peek(ChunkKey(namespace, d)) for t in self.tiers) for d in digests]

    async def delete(self, namespace: str, digests: Sequence[bytes]) -> list[bool]:
        out = []
        for digest in digests:
            key = ChunkKey(namespace, digest)
            out.append(any([await t.delete(key) for t in self.tiers]))
        return out

    async def clear(self, namespace: str | None) -> int:
        return sum([await t.clear(namespace) for t in self.tiers])

    def pin(self, namespace: str, digests: Sequence[bytes]) -> list[bool]:
        return [self.memory.pin(ChunkKey(namespace, d)) for d in digests]

    def unpin(self, namespace: str, digests: Sequence[bytes]) -> list[bool]:
        return [self.memory.unpin(ChunkKey(namespace, d)) for d in digests]

    def stats(self, namespace: str | None = None) -> dict[str, Any]:
        c = self.lookup_counters
        out: dict[str, Any] = {
            "tiers": {t.name: t.stats() for t in self.tiers},
            "lookups": c.lookups,
            "lookup_chunks": c.chunks_asked,
            "lookup_hit_chunks": c.chunks_hit,
            "lookup_hit_rate": round(c.chunks_hit / c.chunks_asked, 4) if c.chunks_asked else 0.0,
        }
        namespaces = self.memory.namespaces()
        if namespace is not None:
            chunks, nbytes = namespaces.get(namespace, (0, 0))
            out["namespace"] = {"name": namespace, "chunks": chunks, "stored_bytes": nbytes}
        else:
            out["namespaces"] = {ns: {"chunks": c_, "stored_bytes": b} for ns, (c_, b) in namespaces.items()}
        return out

    async def close(self) -> None:
        for tier in self.tiers:
            await tier.close()
