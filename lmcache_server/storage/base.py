"""The storage interface every tier implements, and the types it speaks.

Primitives:

- :class:`ChunkKey`: (namespace, 32-byte digest); opaque to the tiers.
- :class:`Chunk`: a readable view of a stored chunk; ``release()`` it when done
  (a memory-tier chunk is leased: its bytes cannot be reused until released).
- :class:`ChunkTokens` (from the client's keys): a chunk's token ids and the key
  before it, as a put sent them and the server checked them; kept only until
  the chunk is announced.
- :class:`Residency`: what the tiered store tells a listener (the KV-event
  announcer) about chunks becoming readable on this node and leaving it;
  :class:`RemoteListener`: what the Redis tier tells it about what Redis holds.
- :class:`TierLinks`: the line from the tiers to the tiered store that holds
  them, made before either and handed to both; :class:`TierListener`: what the
  tiers tell the store on it (memory's victims, removals, records' token ids).
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

    def tokens(self, key: ChunkKey) -> ChunkTokens | None:
        """The token ids (and parent key) of the announced chunk ``key``, written into
        its records below memory (:mod:`.chunkfile`); None when not announced."""
        ...

    def moved(self, key: ChunkKey, tier: str) -> None:
        """The fastest local tier holding ``key`` is now ``tier`` (it left memory but
        the disk holds it, or it was promoted back to memory)."""
        ...

    def removed(self, key: ChunkKey) -> None:
        """``key`` left the last local tier that held it."""
        ...

    def remote_holds(self, key: ChunkKey) -> bool:
        """Whether this node's Redis uplink is known to hold ``key`` (the node can still
        serve it when it left the local tiers: ``moved`` to the Redis tier, not removed)."""
        ...

    def cleared(self, namespace: str | None) -> None:
        """Every chunk of ``namespace`` (None: all) is being removed."""
        ...

    def stats(self) -> dict[str, Any]: ...


class RemoteListener(Protocol):
    """Told by the Redis tier what Redis holds for this node (the KV-event announcer's
    memory of it); on the event loop; must never block or raise."""

    def written(self, keys: Sequence[ChunkKey], sent_at: float) -> None:
        """Redis acknowledged the SETs of ``keys``, sent at ``sent_at`` (time.monotonic())."""
        ...

    def found(self, keys: Sequence[ChunkKey]) -> None:
        """A read from Redis found ``keys``."""
        ...

    def gone(self, keys: Sequence[ChunkKey]) -> None:
        """Redis does not hold ``keys`` (a read or EXISTS missed), or they are being deleted."""
        ...

    def cleared(self, namespace: str | None) -> None:
        """Every key of ``namespace`` (None: all) is being cleared."""
        ...

    def down(self) -> None:
        """The uplink went down: nothing in Redis can be served until it is back."""
        ...


class TierListener(Protocol):
    """What the tiers tell the tiered store that holds them (:class:`TierLinks`); on the
    event loop."""

    def evicted(self, key: ChunkKey, chunk: Chunk, lend: bool) -> bool:
        """Memory evicts ``key``: ``chunk`` is leased to the listener, *lent* when ``lend``
        (it may keep the lease, the extent is reused once released).  False declines a
        lent chunk, which then stays in memory."""
        ...

    def left_memory(self, key: ChunkKey) -> None:
        """``key`` left memory (evicted, deleted, cleared)."""
        ...

    def left_disk(self, key: ChunkKey) -> None:
        """``key`` is no longer readable from the disk (dropped, deleted, a spill not written)."""
        ...

    def tokens_of(self, key: ChunkKey) -> ChunkTokens | None:
        """The token ids a record of ``key`` carries below memory (:mod:`.chunkfile`)."""
        ...


class TierLinks:
    """The line from the tiers to the tiered store that will hold them.  Made before
    either, it is handed to each tier's constructor (memory, disk, Redis) and then to
    the store's, which listens on it (:meth:`listen`, once, as it is built): the
    tiers and the store need each other, and neither is assigned onto the other.
    Until a store listens (a tier on its own) the tiers tell nobody: an evicted
    chunk is dropped, a record carries no token ids.

    ``spill_ahead_bytes``: None when no tier below memory takes its spills; else
    memory lends its victims to the spill and evicts that many bytes ahead
    (``spill_ahead_size``; see :mod:`.memory.eviction`)."""

    def __init__(self, spill_ahead_bytes: int | None = None) -> None:
        self.spill_ahead_bytes = spill_ahead_bytes
        self._listener: TierListener | None = None
        self._remote: RemoteListener | None = None

    @property
    def listener(self) -> TierListener | None:
        return self._listener

    def listen(self, listener: TierListener) -> None:
        if self._listener is not None:
            raise ValueError("these tiers are held by a store already")
        self._listener = listener

    @property
    def remote(self) -> RemoteListener | None:
        return self._remote

    def hear_remote(self, listener: RemoteListener) -> None:
        """What Redis holds is told to ``listener`` by the Redis tier (the KV-event
        announcer's memory of it, built after the tier: its audits ask the tier)."""
        if self._remote is not None:
            raise ValueError("the Redis tier is heard already")
        self._remote = listener

    def tokens_of(self, key: ChunkKey) -> ChunkTokens | None:
        """The token ids a record of ``key`` carries (None: nobody listens, or none)."""
        return self._listener.tokens_of(key) if self._listener is not None else None


class Chunk:
    """A stored chunk's bytes; a context manager that releases its lease on exit."""

    __slots__ = ("data", "tier", "offset", "tokens", "_release")

    def __init__(
        self, data: memoryview, tier: str, release: Callable[[], None] | None = None, offset: int | None = None
    ):
        self.data = data
        self.tier = tier
        self.offset = offset
        """Where the bytes start in the memory pool (memory-tier chunks), else None."""
        self.tokens: ChunkTokens | None = None
        """The chunk's token ids when its record carried them (a Redis read; see
        :mod:`.chunkfile`), so that a promotion can announce it."""
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
