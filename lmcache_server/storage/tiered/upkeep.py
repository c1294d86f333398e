"""What is done to chunks already stored: delete, clear, pin and unpin, through every tier.

Each waits for a fill of its keys by a put (:mod:`.filling`) first, so a chunk
answered STORED is never missed.  A delete tells the uplink first (its
listener forgets the key: leaving memory now is no move to Redis), then goes
memory first, so that a read meanwhile cannot queue the chunk for Redis again
after its Redis delete.  The gate forgets deleted and cleared keys; the
KV-event announcer is told of a clear before the tiers clear.

Primitives: :class:`Upkeep` (``delete``, ``clear``, ``pin``, ``unpin``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..base import ChunkKey, Residency, Tier
from .filling import Filling
from .gate import StoreGate
from .roles import Tiers


class Upkeep:
    def __init__(self, tiers: Tiers, filling: Filling, gate: StoreGate | None, events: Residency | None):
        self._tiers = tiers
        self._filling = filling
        self._gate = gate
        self._events = events

    async def delete(self, namespace: str, digests: Sequence[bytes]) -> list[bool]:
        remote = self._tiers.remote
        out = []
        for digest in digests:
            key = ChunkKey(namespace, digest)
            await self._filling.filled(key)
            if remote is not None:
                remote.deleting([key])  # first: leaving memory now is no move to Redis
            # Memory first, as ever: a read meanwhile cannot queue the chunk for Redis again
            # after its Redis delete (it would come back there).
            out.append(any([await t.delete(key) for t in self._tiers.all]))
            if self._gate is not None:
                self._gate.deleted(key)
        return out

    async def clear(self, namespace: str | None) -> int:
        """Chunks removed (a chunk in two local tiers counts once; Redis keys count
        when no local tier held them)."""
        await self._filling.settled(namespace)
        if self._events is not None:
            self._events.cleared(namespace)
        keys: set[ChunkKey] = set()
        for tier in self._tiers.all:
            keys.update(_keys_of(tier, namespace))
        remote_removed = 0
        for tier in self._tiers.all:
            removed = await tier.clear(namespace)
            if tier is self._tiers.remote:
                remote_removed = removed
        if self._gate is not None:
            self._gate.cleared(namespace)  # that namespace's keys only
        return max(len(keys), remote_removed)

    async def pin(self, namespace: str, digests: Sequence[bytes]) -> list[bool]:
        keys = [ChunkKey(namespace, d) for d in digests]
        for key in keys:
            await self._filling.filled(key)
        return [self._tiers.memory.pin(key) for key in keys]

    async def unpin(self, namespace: str, digests: Sequence[bytes]) -> list[bool]:
        keys = [ChunkKey(namespace, d) for d in digests]
        for key in keys:
            await self._filling.filled(key)
        return [self._tiers.memory.unpin(key) for key in keys]


def _keys_of(tier: Tier, namespace: str | None) -> list[ChunkKey]:
    return [k for k in tier.keys() if namespace is None or k.namespace == namespace]  # noqa: SIM118 - a Tier is no dict
