"""The storage interface every tier implements, and the types it speaks.

Primitives:

- :class:`ChunkKey`: (namespace, 32-byte digest); opaque to the tiers.
- :class:`Chunk`: a readable view of a stored chunk; ``release()`` it when done
  (a memory-tier chunk is leased: its bytes cannot be reused until released).
- :class:`ChunkTokens` (from the client's keys): a chunk's token ids and the key
  before it, as a put sent them and the server checked them; kept only until
  the chunk is announced.
- :class:`Residency`: what the tiered store tells a listener (the KV-event
  announcer) about chunks becoming readable on this node and leaving it.
- :class:`Tier`: ``get`` (miss = None), ``put`` (a PutStatus), ``contains``,
  ``delete``, ``clear``, ``close``, plus ``peek`` and ``stats`` for lookups
  and introspection.  Promotion and spill between tiers live in
  the tiered store, written once, not in the tiers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from lmcache_client.keys import ChunkTokens
from lmcache_client.protocol import PutStatus


class ChunkKey(NamedTuple):
    namespace: str
    digest: bytes


class Residency(Protocol):
    """Told by the tiered store, on the event loop; must never block or raise."""

    def stored(self, key: ChunkKey, tokens: ChunkTokens, tier: str) -> None:
        """``key`` became readable in ``tier`` (a put with token ids)."""
        ...

    def announced(self, key: ChunkKey) -> bool:
        """Whether ``key`` was announced (and not yet removed)."""
        ...

    def moved(self, key: ChunkKey, tier: str) -> None:
        """The fastest local tier holding ``key`` is now ``tier`` (it left memory but
        the disk holds it, or it was promoted back to memory)."""
        ...

    def removed(self, key: ChunkKey) -> None:
        """``key`` left the last local tier that held it."""
        ...

    def cleared(self, namespace: str | None) -> None:
        """Every chunk of ``namespace`` (None: all) is being removed."""
        ...

    def stats(self) -> dict[str, Any]: ...


class Chunk:
    """A stored chunk's bytes; a context manager that releases its lease on exit."""

    __slots__ = ("data", "tier", "offset", "_release")

    def __init__(
        self, data: memoryview, tier: str, release: Callable[[], None] | None = None, offset: int | None = None
    ):
        self.data = data
        self.tier = tier
        self.offset = offset
        """Where the bytes start in the memory pool (memory-tier chunks), else None."""
        self._release = release

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def release(self) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            release()

    def __enter__(self) -> Chunk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Tier(Protocol):
    """One storage tier.  Every method may be called only from the event loop."""

    name: str

    async def get(self, key: ChunkKey) -> Chunk | None: ...

    async def put(self, key: ChunkKey, data: Any) -> PutStatus: ...

    async def contains(self, keys: Sequence[ChunkKey]) -> list[bool]: ...

    async def delete(self, key: ChunkKey) -> bool: ...

    async def clear(self, namespace: str | None) -> int: ...

    async def close(self) -> None: ...

    def peek(self, key: ChunkKey) -> bool:
        """Whether ``key`` is stored, without touching recency or hit counters."""
        ...

    def peek_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """:meth:`peek` of every key (one call per lookup, not per key)."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def keys(self) -> Sequence[ChunkKey]:
        """Every stored key (for clear's accounting and admin listings)."""
        ...

    def namespaces(self) -> dict[str, tuple[int, int]]:
        """namespace -> (chunks, payload bytes) stored in this tier."""
        ...
