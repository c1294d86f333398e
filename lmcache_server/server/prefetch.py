"""Prefetch while parked: a ``lookup`` with ``prefetch: true`` (docs/protocol.md §5.5).

An engine parks a request between its lookup and its load.  When the lookup
says that leading chunks sit on disk or in Redis, the daemon, once the lookup's
reply is sent, promotes them into memory in a background task, so the load
that follows is a memory hit.  The reply itself is the plain lookup reply.

Bounds (optional work never crowds out requests):

- bytes: a prefetch takes the bytes it promotes from the server's in-flight
  byte budget while it reads them, in windows of leading chunks: prefetches
  together hold at most half of ``max_inflight_bytes`` and only bytes the
  budget has free (no "an idle budget admits anything", as for requests).  A
  prefetch whose next chunk does not fit stops there and is counted as
  declined (what it promoted before counts as prefetched);
- keys: at most one prefetch per key at a time: keys a running prefetch holds
  are left out of a new one, and a lookup whose chunks are all being
  prefetched starts nothing;
- tasks: at most ``MAX_PREFETCHES`` at once; a lookup past it is declined;
- shutdown: :meth:`Prefetcher.close` cancels them (a promotion gives its room
  back once its copy thread is done).

Access: a prefetch reads only the namespace its lookup was allowed to read
(a lookup needs ``ro`` on its namespace, §2.6); promotions obey the memory
tier's policy and tenant quotas like any other.

Primitives: :class:`Prefetcher` (``start``, ``close``, ``stats``),
:func:`prefetch_flag` (the request's flag, validated), ``MAX_PREFETCHES``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from lmcache_client.protocol import ErrorCode, ProtocolError, Request

from ..storage import ChunkKey, TieredStore
from ..supervisor import Supervisor
from .admission import ByteBudget

logger = logging.getLogger(__name__)

MAX_PREFETCHES = 64
"""Prefetches running at once; a lookup past it is declined."""


def prefetch_flag(request: Request) -> bool:
    """The lookup's ``prefetch`` field: absent or nil is False; anything but a bool
    is refused (BAD_REQUEST), as ``all: 1`` is for clear."""
    value = request.fields.get("prefetch")
    if value is None or type(value) is bool:
        return bool(value)
    raise ProtocolError(ErrorCode.BAD_REQUEST, f"'prefetch' must be true or false, not {value!r:.40}", request.id)


@dataclasses.dataclass
class PrefetchCounters:
    prefetches: int = 0
    """Prefetches started (that took budget for at least one chunk)."""
    chunks: int = 0
    """Chunks promoted into memory by prefetches."""
    bytes: int = 0
    """Their payload bytes."""
    declined: int = 0
    """Prefetches not started, or stopped short: the budget had no room for the next chunk, or too many ran."""


class Prefetcher:
    def __init__(
        self,
        store: TieredStore,
        budget: ByteBudget,
        supervisor: Supervisor | None = None,
        max_running: int = MAX_PREFETCHES,
    ):
        self.store = store
        self.budget = budget
        self.supervisor = supervisor if supervisor is not None else store.supervisor
        self.max_running = max_running
        self.counters = PrefetchCounters()
        self.held_bytes = 0
        """Bytes of the budget prefetches hold now."""
        self._running: set[ChunkKey] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def start(self, namespace: str, digests: Sequence[bytes], tiers: Sequence[str | None]) -> None:
        """Promote the leading hits of a lookup (``tiers`` as it answered) that a lower
        tier holds, in the background; returns at once."""
        memory = self.store.memory.name
        keys: list[ChunkKey] = []
        for digest, tier in zip(digests, tiers):
            if tier is None:
                break  # only a leading run of hits is of use to the engine
            key = ChunkKey(namespace, digest)
            if tier != memory and key not in self._running:
                self._running.add(key)
                keys.append(key)
        if not keys:
            return
        if self._closed or len(self._tasks) >= self.max_running:
            self._running.difference_update(keys)
            self.counters.declined += not self._closed
            return
        task = asyncio.get_running_loop().create_task(self._run(keys), name="lmcache:prefetch")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, keys: list[ChunkKey]) -> None:
        try:
            pending = list((await self.store.prefetch_sizes(keys)).items())
            started = False
            while pending:
                window, nbytes = self._window(pending)
                if not window:
                    self.counters.declined += 1
                    logger.debug("prefetch of %d chunks declined: no room in the in-flight budget", len(pending))
                    return
                if not started:
                    started = True
                    self.counters.prefetches += 1
                del pending[: len(window)]
                taken = self.budget.try_acquire(nbytes)
                assert taken, "a prefetch window took more than the budget had free"
                self.held_bytes += nbytes
                try:
                    promoted = await self.store.prefetch(window)
                finally:
                    self.held_bytes -= nbytes
                    self.budget.release(nbytes)
                self.counters.chunks += len(promoted)
                self.counters.bytes += sum(promoted)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # a bug: counted and logged; the lookup was answered already
            self.supervisor.failed("prefetch", err)
        finally:
            self._running.difference_update(keys)

    def _window(self, pending: list[tuple[ChunkKey, int]]) -> tuple[list[ChunkKey], int]:
        """The leading chunks of ``pending`` the budget has room for now, and their bytes."""
        budget = self.budget
        room = min(budget.max_bytes // 2 - self.held_bytes, budget.max_bytes - budget.in_use)
        window: list[ChunkKey] = []
        total = 0
        for key, size in pending:
            if total + size > room:
                break
            window.append(key)
            total += size
        return window, total

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "prefetches": c.prefetches,
            "prefetched_chunks": c.chunks,
            "prefetched_bytes": c.bytes,
            "declined": c.declined,
            "running": len(self._tasks),
            "held_bytes": self.held_bytes,
        }

    async def close(self) -> None:
        """Start no more; cancel the running ones and wait for them (idempotent)."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
