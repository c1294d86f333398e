"""What this node's Redis uplink holds for it: a chunk that leaves the last local
tier but that Redis still holds (a read falls through to Redis and promotes it)
is announced as moved to ``medium: CPU, locality: REMOTE`` instead of removed
(docs/events.md, "Media and locality").

The daemon cannot ask Redis synchronously when a chunk leaves memory, so
:class:`RemoteHeld` remembers, bounded, which keys Redis is known to hold:

- known held when the writer got Redis' acknowledgement of its SET (until the
  key's TTL, ``remote_ttl_s``, counted from when its pipeline was sent, less
  :data:`EXPIRY_MARGIN_S`), or when a read of it from Redis found it;
- forgotten when it is deleted or cleared, at its TTL, when a read or an
  ``EXISTS`` of it misses in Redis, when the audit finds it gone, when the
  uplink goes down (the node cannot serve it then: every key is forgotten), and,
  oldest first, past ``max_chunks`` (``events_remote_max_chunks``).

Forgetting a chunk announced REMOTE announces its removal
(:meth:`.announcer.Announcer.removed`).  The Redis tier tells it what happened
through :class:`..storage.base.RemoteListener`; the announcer asks
:meth:`RemoteHeld.holds` when a chunk leaves the local tiers.

:meth:`RemoteHeld.run` (a supervised task) forgets keys at their TTL and, every
``audit_s`` (``events_remote_audit_s``; 0: never), asks Redis whether the chunks
announced REMOTE are still there: ``EXISTS`` in pipelines of at most
:data:`AUDIT_BATCH` keys, one round trip each.  Redis keyspace notifications
are not used: they need ``notify-keyspace-events`` in the server's config, and
on a cluster a subscription per node.  So an eviction Redis makes on its own
(``maxmemory``) is seen at the next audit or read of the key.

Primitives: :class:`RemoteHeld` (``holds``, ``run``, ``stats``, and the
:class:`..storage.base.RemoteListener` hooks; the announcer builds it from a
:class:`RemoteSettings`), :func:`placement`, :data:`REMOTE`,
:data:`AUDIT_BATCH`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

from ..storage.base import ChunkKey

logger = logging.getLogger(__name__)

LOCAL = "LOCAL"
"""The ``locality`` of every block a local tier holds (vLLM's LOCAL: this node serves it)."""
REMOTE = "REMOTE"
"""The medium label of chunks only Redis holds for this node: their own block index per
topic, sent as ``medium: CPU, locality: REMOTE`` (:func:`placement`)."""
REMOTE_TIERS = frozenset({"redis", "mooncake"})
"""The remote tier's names (Redis, Mooncake): an announced chunk ``moved`` there is labelled :data:`REMOTE`."""


def placement(medium: str) -> tuple[str, str]:
    """The ``medium`` and ``locality`` the blocks of an index (a medium label) are sent with."""
    return ("CPU", REMOTE) if medium == REMOTE else (medium, LOCAL)


AUDIT_BATCH = 256
"""Known keys the audit looks at between two yields; at most this many asked per round trip
(a pipeline of EXISTS)."""
EXPIRY_MARGIN_S = 0.5
"""A key is forgotten this long before Redis expires it (at most a quarter of the TTL)."""


class Announced(Protocol):
    """What forgetting needs of the announcer (:class:`.announcer.Announcer` is one)."""

    def medium(self, key: ChunkKey) -> str | None: ...

    def removed(self, key: ChunkKey) -> None: ...


class Redis(Protocol):
    """What the audit needs of the Redis tier (:class:`..storage.remote.RemoteTier` is one)."""

    @property
    def up(self) -> bool: ...

    async def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]: ...


@dataclasses.dataclass
class RemoteCounters:
    remote_moved_chunks: int = 0
    """Chunks announced REMOTE (they left the local tiers, Redis holds them)."""
    remote_removed_chunks: int = 0
    """Chunks announced REMOTE whose removal was announced (forgotten)."""
    remote_expired: int = 0
    """Keys forgotten at their TTL."""
    remote_missed: int = 0
    """Keys forgotten because a read, an EXISTS or the audit found them gone from Redis."""
    remote_evicted: int = 0
    """Keys forgotten, oldest first, past ``events_remote_max_chunks``."""
    remote_down_forgets: int = 0
    """Keys forgotten because the uplink went down."""
    remote_audits: int = 0
    """Audit rounds run (each asks Redis about every chunk announced REMOTE)."""


@dataclasses.dataclass(frozen=True)
class RemoteSettings:
    """What :class:`RemoteHeld` watches and its bounds (``events_remote_*``, ``remote_ttl_s``)."""

    redis: Redis
    max_chunks: int
    ttl_s: float
    audit_s: float


class RemoteHeld:
    """The keys Redis is known to hold for this node, at most ``max_chunks`` (oldest
    forgotten first), each until ``ttl_s`` (0: no TTL) after its write; ``audit_s``
    (0: no audit) between two audits of the chunks the ``announcer`` announced REMOTE."""

    def __init__(self, announcer: Announced, redis: Redis, *, max_chunks: int, ttl_s: float, audit_s: float):
        if max_chunks < 1:
            raise ValueError(f"max_chunks must be at least 1, not {max_chunks}")
        self.announcer = announcer
        self.redis = redis
        self.max_chunks = max_chunks
        self.ttl_s = ttl_s
        self.audit_s = audit_s
        self.margin_s = min(EXPIRY_MARGIN_S, ttl_s / 4)
        self.counters = RemoteCounters()
        # key -> when it is forgotten (time.monotonic(); inf: no TTL), oldest first
        self._held: OrderedDict[ChunkKey, float] = OrderedDict()
        self._wake = asyncio.Event()  # a key with an expiry arrived while the loop had none to wait for

    def __len__(self) -> int:
        return len(self._held)

    # -- asked by the announcer -------------------------------------------------------
    def holds(self, key: ChunkKey) -> bool:
        """Whether Redis is known to hold ``key`` now (its TTL not reached)."""
        until = self._held.get(key)
        return until is not None and until > time.monotonic()

    def moved(self, key: ChunkKey) -> None:
        """``key`` was announced REMOTE (counted)."""
        self.counters.remote_moved_chunks += 1

    # -- told by the Redis tier (storage.base.RemoteListener) ------------------------------
    def written(self, keys: Sequence[ChunkKey], sent_at: float) -> None:
        """Redis acknowledged the SETs of ``keys``, sent at ``sent_at`` (time.monotonic())."""
        until = sent_at + self.ttl_s - self.margin_s if self.ttl_s else math.inf
        for key in keys:
            self._held.pop(key, None)
            self._held[key] = until
        self._bound()
        if self.ttl_s and keys:
            self._wake.set()

    def found(self, keys: Sequence[ChunkKey]) -> None:
        """A read from Redis found ``keys``.  A key not known yet is held until the TTL
        from now (an upper bound: another node may have written it earlier; the audit
        corrects it); a known one keeps its expiry."""
        until = time.monotonic() + self.ttl_s - self.margin_s if self.ttl_s else math.inf
        added = False
        for key in keys:
            if key not in self._held:
                self._held[key] = until
                added = True
        if added:
            self._bound()
            if self.ttl_s:
                self._wake.set()

    def gone(self, keys: Sequence[ChunkKey]) -> None:
        """Redis does not hold ``keys`` (a read or EXISTS missed), or they are being deleted."""
        for key in keys:
            if self._held.pop(key, None) is not None:
                self.counters.remote_missed += 1
                self._withdraw(key)

    def cleared(self, namespace: str | None) -> None:
        """Every key of ``namespace`` (None: all) is being cleared (the announcer was
        told first, so nothing is announced here)."""
        for key in [k for k in self._held if namespace is None or k.namespace == namespace]:
            del self._held[key]
            self._withdraw(key)

    def down(self) -> None:
        """The uplink went down: the node cannot serve from Redis, so forget every key."""
        if not self._held:
            return
        logger.info("Redis uplink down: %d chunks known in Redis forgotten (announced REMOTE ones removed)",
                    len(self._held))  # fmt: skip
        held, self._held = self._held, OrderedDict()
        self.counters.remote_down_forgets += len(held)
        for key in held:
            self._withdraw(key)

    # -- forgetting ------------------------------------------------------------------------
    def _withdraw(self, key: ChunkKey) -> None:
        """``key`` is no longer known in Redis: if it was announced REMOTE, announce its removal."""
        if self.announcer.medium(key) == REMOTE:
            self.counters.remote_removed_chunks += 1
            self.announcer.removed(key)

    def _bound(self) -> None:
        while len(self._held) > self.max_chunks:
            key, _ = self._held.popitem(last=False)
            self.counters.remote_evicted += 1
            self._withdraw(key)

    def _expire(self, now: float) -> float:
        """Forget the keys whose TTL passed; returns when the next one is due (inf: none).
        Keys are kept in about the order they expire (each from when it was written or
        first read); one that expires behind a later one is caught when that one is
        (``holds`` is exact meanwhile)."""
        while self._held:
            key, until = next(iter(self._held.items()))
            if until > now:
                return until
            del self._held[key]
            self.counters.remote_expired += 1
            self._withdraw(key)
        return math.inf

    async def _audit(self) -> None:
        """Ask Redis whether each chunk announced REMOTE is still there; announce the gone
        ones.  The known keys are looked at a slice of AUDIT_BATCH at a time (yielding to the
        event loop between slices), the REMOTE ones of a slice asked in one round trip."""
        self.counters.remote_audits += 1
        held = list(self._held.items())
        for start in range(0, len(held), AUDIT_BATCH):
            batch = [(k, u) for k, u in held[start : start + AUDIT_BATCH] if self.announcer.medium(k) == REMOTE]
            if not batch:
                await asyncio.sleep(0)
                continue
            if not self.redis.up:
                return  # down: every key was forgotten already
            found = await self.redis.exists_many([k for k, _ in batch])
            if not self.redis.up:
                return  # it went down during the round trip: its answers are misses, not facts
            for (key, until), there in zip(batch, found):
                # unless written again meanwhile (a newer expiry): that write may have landed after EXISTS
                if not there and self._held.get(key) == until:
                    del self._held[key]
                    self.counters.remote_missed += 1
                    self._withdraw(key)

    async def run(self) -> None:
        """Forget keys at their TTL and audit every ``audit_s``, until cancelled."""
        next_audit = time.monotonic() + self.audit_s if self.audit_s else math.inf
        while True:
            now = time.monotonic()
            due = self._expire(now)
            if now >= next_audit:
                await self._audit()
                next_audit = time.monotonic() + self.audit_s
                continue
            wait = min(due, next_audit) - now
            self._wake.clear()
            if math.isinf(wait):
                await self._wake.wait()
            else:
                try:
                    await asyncio.wait_for(self._wake.wait(), max(wait, 0.001))
                except TimeoutError:
                    pass

    def stats(self) -> dict[str, Any]:
        return {"remote_known_chunks": len(self._held), **dataclasses.asdict(self.counters)}
