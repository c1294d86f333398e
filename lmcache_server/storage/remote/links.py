"""What :class:`.tier.RemoteTier` needs of the store it shares with other nodes: the
:class:`RemoteLink` protocol, and the up/down state every link holds (:class:`LinkState`).
Two links implement it: :class:`.link.RedisLink` (Redis or a Redis Cluster) and
:class:`.mooncake.MooncakeLink` (Mooncake Store).

A link owns the connection, the daemon's key names and its ``state``: up or down,
the background reconnect (``probing``, the link's own probe) and the counters;
``wake`` is set whenever the state changes.  Its requests raise one of ``errors``
on an outage (the tier then calls ``state.failed``, which marks the link down);
``timeouts`` are the errors of a request that ran out of time.

Primitives: :class:`RemoteLink` (``connect``, ``remote_key``, ``exists``, ``sizes``,
``read``, ``write``, ``drop``, ``remove``, ``clear``, ``aclose``), :class:`LinkState`
(``connected``, ``mark_down``, ``failed``), :data:`LinkFactory`, the key names both
links use (:func:`key_name`, :func:`key_scope`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from ...supervisor import Supervisor
from ..base import ChunkKey

logger = logging.getLogger(__name__)


def key_scope(prefix: str, namespace: str | None) -> str:
    """What every key of ``namespace`` (None: of every namespace) under ``prefix`` starts with."""
    if namespace is None:
        return prefix
    return f"{prefix}{hashlib.sha256(namespace.encode()).hexdigest()[:16]}:"


def key_name(prefix: str, key: ChunkKey) -> str:
    """The name a chunk is stored under: ``<prefix><16 hex of SHA-256(namespace)>:<64 hex key>``."""
    return key_scope(prefix, key.namespace) + key.digest.hex()


@dataclasses.dataclass
class RemoteCounters:
    """The remote tier's counters (``admin stats``, ``lmcache_tier_*``); ``op_calls`` and
    ``op_seconds`` count each request to the store by operation (read, write, exists,
    sizes, remove, clear), failed ones included."""

    hits: int = 0
    misses: int = 0
    stores: int = 0
    dropped_writes: int = 0
    write_errors: int = 0
    read_errors: int = 0
    corrupt: int = 0
    reconnects: int = 0
    op_calls: dict[str, int] = dataclasses.field(default_factory=dict)
    op_seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def timed(self, op: str, started: float) -> None:
        """One request of ``op`` that began at ``started`` (time.monotonic) ended now."""
        self.op_calls[op] = self.op_calls.get(op, 0) + 1
        self.op_seconds[op] = self.op_seconds.get(op, 0.0) + time.monotonic() - started


class LinkState:
    """A link's up/down state: ``up`` is False from a failure until ``probe`` (the
    link's own, awaited until the store answers again) returns; ``wake`` is set
    whenever the state changes (the tier's writer waits on it); ``on_down`` is
    called after each failure that marks it down.  ``where`` names the store in log
    lines; ``errors`` are what an outage raises (anything else is also reported to
    the supervisor as a task failure)."""

    def __init__(
        self,
        name: str,
        label: str,
        where: str,
        errors: tuple[type[BaseException], ...],
        probe: Callable[[], Awaitable[None]],
        supervisor: Supervisor | None = None,
        on_down: Callable[[], None] | None = None,
    ):
        self.name, self.label, self.where, self.errors = name, label, where, errors
        self._probe = probe
        self.supervisor = supervisor if supervisor is not None else Supervisor()
        self._on_down = on_down
        self.counters = RemoteCounters()
        self.up = False
        self.wake = asyncio.Event()
        self.probing: asyncio.Task[None] | None = None

    def connected(self) -> None:
        self.up = True
        logger.info("%s %s connected", self.label, self.where)

    def mark_down(self, err: BaseException) -> None:
        if self.up or self.probing is None:
            logger.warning("%s %s down (%s: %s); serving from memory and disk, retrying",
                           self.label, self.where, type(err).__name__, err)  # fmt: skip
        self.up = False
        self.wake.set()
        if self.probing is None or self.probing.done():
            self.probing = self.supervisor.spawn(f"{self.name}_reconnect", self._reconnect)
        if self._on_down is not None:
            self._on_down()

    def failed(self, op: str, err: Exception) -> None:
        """A request to the store failed: the link is down.  An error that is not an
        outage (a client library surprised by a reply, a bug) is also logged with its
        traceback and counted as a task failure; the request that asked still gets
        its miss, never INTERNAL."""
        if not isinstance(err, self.errors):
            self.supervisor.failed(f"{self.name}_{op}", err)
        self.mark_down(err)

    async def _reconnect(self) -> None:
        await self._probe()
        self.up = True
        self.counters.reconnects += 1
        logger.info("%s %s restored", self.label, self.where)
        self.wake.set()


class RemoteLink(Protocol):
    name: str  # the tier's name (stats, metrics, lookups): "redis" or "mooncake"
    label: str  # how log lines name it: "Redis uplink", "Mooncake tier"
    from_pool: bool  # writes are sent from the memory pool (header, payload), not as a copied record
    errors: tuple[type[BaseException], ...]
    timeouts: tuple[type[BaseException], ...]
    url: str
    key_prefix: str
    timeout_s: float
    state: LinkState

    async def connect(self) -> None:
        """The first contact: up if it answers, else down and reconnecting (never raises)."""

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


LinkFactory = Callable[..., RemoteLink]
"""What makes a tier's link, called with ``on_down=`` (what it calls when it goes down):
``functools.partial(RedisLink, url, ...)`` or ``functools.partial(MooncakeLink, url, settings, ...)``."""
