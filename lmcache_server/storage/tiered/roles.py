"""The roles the tiered store's tiers play, as the interfaces the store holds.

The store never names a tier's class: it holds a :class:`Memory` (the pool every
put goes to and every hit is served from), at most one :class:`SpillTarget` (the
tier below memory that takes what memory evicts, read straight into the pool:
the disk) and at most one :class:`Uplink` (the shared tier every stored chunk is
queued for, read a batch per round trip: Redis).  A new lower tier is a
subpackage implementing one of these roles (and :class:`..base.Tier`), plus its
place in :class:`Tiers`.

Primitives: :class:`Memory`, :class:`SpillTarget`, :class:`Uplink`, :class:`Tiers`
(the tiers of one store, the record its parts share).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from lmcache_client.keys import ChunkTokens
from lmcache_client.protocol import PutStatus

from ..base import Chunk, ChunkKey, Tier
from ..memory import PinRoom, Reservation


class _Capacity(Protocol):
    @property
    def capacity(self) -> int: ...


class _Counters(Protocol):
    rejections: int


class Memory(Tier, Protocol):
    """The memory tier as the store uses it (:class:`..memory.MemoryTier` is one): two-phase
    stores into the pool, leases, pins and the wait for room spills will free."""

    @property
    def allocator(self) -> _Capacity: ...
    @property
    def counters(self) -> _Counters: ...

    def reserve(self, key: ChunkKey, size: int, parent: ChunkKey | None = None) -> Reservation | PutStatus: ...
    def commit(self, reservation: Reservation) -> PutStatus: ...
    def abort(self, reservation: Reservation) -> None: ...
    def reserve_room(self, size: int) -> Reservation | None: ...
    def bind_room(
        self, room: Reservation, key: ChunkKey, parent: ChunkKey | None = None
    ) -> Reservation | PutStatus: ...
    def lease(self, key: ChunkKey) -> Chunk | None: ...
    def room_coming(self, size: int) -> bool: ...
    async def wait_for_room(self, timeout_s: float) -> bool: ...
    def pin(self, key: ChunkKey) -> bool: ...
    def unpin(self, key: ChunkKey) -> bool: ...
    def pinned_in(self, namespace: str) -> tuple[int, int]: ...
    def pin_cost(self, key: ChunkKey) -> int | None: ...
    def pin_room(self, namespace: str) -> PinRoom: ...
    async def close(self, keep_segment: bool = False) -> None: ...


class SpillTarget(Tier, Protocol):
    """The tier that takes memory's evictions (:class:`..disk.DiskTier` is one): a bounded
    write-behind queue, and reads straight into reserved pool memory."""

    found_tokens: list[tuple[ChunkKey, ChunkTokens]]

    def accepts(self, size: int) -> bool: ...
    def enqueue(self, key: ChunkKey, data: Any, release: Callable[[], None] | None = None) -> bool: ...
    def victim_for(self, size: int) -> ChunkKey | None: ...
    def payload_size(self, key: ChunkKey) -> int | None: ...
    async def get(self, key: ChunkKey, out: memoryview | None = None) -> Chunk | None: ...
    async def flush(self, timeout_s: float) -> bool: ...


class Uplink(Tier, Protocol):
    """The shared tier every stored chunk is queued for (:class:`..remote.RemoteTier` is one):
    a bounded write-behind queue, and batched reads, one round trip each."""

    def enqueue(self, key: ChunkKey, data: Any, release: Callable[[], None] | None = None) -> bool: ...
    async def get_many(self, keys: Sequence[ChunkKey]) -> list[Chunk | None]: ...
    async def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]: ...
    async def value_sizes(self, keys: Sequence[ChunkKey]) -> list[int]: ...
    def deleting(self, keys: Sequence[ChunkKey]) -> None: ...
    async def flush(self, timeout_s: float) -> bool: ...


@dataclasses.dataclass(frozen=True)
class Tiers:
    """The tiers of one store, fastest first (the record its parts share)."""

    memory: Memory
    disk: SpillTarget | None = None
    remote: Uplink | None = None
    lower: list[Tier] = dataclasses.field(init=False)
    """The tiers below memory, in order."""
    all: list[Tier] = dataclasses.field(init=False)
    """Every tier, fastest first."""

    def __post_init__(self) -> None:
        lower: list[Tier] = [t for t in (self.disk, self.remote) if t is not None]
        object.__setattr__(self, "lower", lower)
        object.__setattr__(self, "all", [self.memory, *lower])
