"""What :class:`.tier.RemoteTier` needs of the store it shares with other nodes: the
:class:`RemoteLink` protocol.  Two links implement it: :class:`.link.RedisLink`
(Redis or a Redis Cluster) and :class:`.mooncake.MooncakeLink` (Mooncake Store).

A link owns the connection, the daemon's key names, the up/down state with its
background reconnect (``probing``; ``wake`` is set whenever the state changes)
and the counters.  Its requests raise one of ``errors`` on an outage (the tier
then calls ``failed``, which marks the link down); ``timeouts`` are the errors
of a request that ran out of time.

Primitives: ``connect``, ``failed``, ``mark_down``, ``remote_key``, ``exists``,
``sizes``, ``read``, ``write``, ``drop``, ``remove``, ``clear``, ``aclose``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ...supervisor import Supervisor
from ..base import ChunkKey

if TYPE_CHECKING:
    from .link import RemoteCounters


class RemoteLink(Protocol):
    name: str  # the tier's name (stats, metrics, lookups): "redis" or "mooncake"
    label: str  # how log lines name it: "Redis uplink", "Mooncake tier"
    from_pool: bool  # writes are sent from the memory pool (header, payload), not as a copied record
    errors: tuple[type[BaseException], ...]
    timeouts: tuple[type[BaseException], ...]
    url: str
    key_prefix: str
    timeout_s: float
    counters: RemoteCounters
    up: bool
    wake: asyncio.Event
    supervisor: Supervisor
    probing: asyncio.Task[None] | None

    async def connect(self) -> None:
        """The first contact: up if it answers, else down and reconnecting (never raises)."""

    def failed(self, op: str, err: Exception) -> None:
        """A request failed: the link is down (an unexpected error is also logged as a task failure)."""

    def mark_down(self, err: BaseException) -> None: ...

    def remote_key(self, key: ChunkKey) -> Any:
        """The key ``key`` is stored under (bytes for Redis, str for Mooncake)."""

    async def exists(self, rkeys: Sequence[Any]) -> list[Any]:
        """Whether each key is stored (ints: 1 or 0), in one round trip."""

    async def sizes(self, rkeys: Sequence[Any]) -> list[Any]:
        """The stored size of each key (0: not stored; an exception: unknown)."""

    async def read(self, rkeys: Sequence[Any]) -> list[Any]:
        """Each key's value: bytes-like, None (not stored) or the exception the store answered for it."""

    async def write(self, records: Sequence[tuple[ChunkKey, Any]], ttl_ms: int | None) -> list[bool]:
        """Store each record (a whole record, or (header, payload) with ``from_pool``);
        True: stored, False: no room now (try again later)."""

    async def drop(self, rkey: Any) -> None:
        """Remove one damaged value (best effort, never raises)."""

    async def remove(self, keys: Sequence[ChunkKey]) -> int: ...

    async def clear(self, namespace: str | None) -> int:
        """Remove every key under the prefix (None) or of one namespace."""

    async def aclose(self) -> None: ...


LinkFactory = Callable[[Callable[[], None]], RemoteLink]
"""What makes a tier's link, given what it calls when it goes down (:func:`.link.redis_link`,
:func:`.mooncake.mooncake_link`)."""
