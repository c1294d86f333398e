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

Cancelled with the request: a ``lookup`` with ``cancel_prefetch: true`` (an
engine whose parked request finished or was aborted before its load) gives
up the prefetches that lookups of its keys joined.  Several requests may share
a prefix, so a prefetch keeps the set of its *owners*: the lookup that started
it and each later lookup with ``prefetch: true`` whose keys it holds.  An owner
is the request as the daemon can tell it (:func:`owner_of`): the connection it
came on and the keys it sent, so a lookup repeated by a parked request joins
once, and a cancel only takes back what the same connection's lookup of the
same keys joined: another reader of the namespace, or a second cancel, takes
nothing.  A prefetch left with no owner is cancelled (counted in
``cancelled``): it stops reading, gives its budget back as the cancel reaches
it and its room once its copy thread is done, and what it promoted before stays
promoted.  A cancel matching no join of its own does nothing.

Access: a prefetch reads only the namespace its lookup was allowed to read
(a lookup needs ``ro`` on its namespace, §2.6); promotions obey the memory
tier's policy and tenant quotas like any other.  A cancel is a lookup too.

The operator's ``prefetch`` op (and ``pin`` of a chunk not in memory) runs the
same windows inline and answers once they are done: :meth:`Prefetcher.promote_now`.

Primitives: :class:`Prefetcher` (``start``, ``promote_now``, ``cancel``, ``close``, ``stats``),
:class:`Promoted`, :func:`owner_of` (who joined a prefetch),
:func:`prefetch_flag` and :func:`cancel_flag` (the request's flags, validated),
``MAX_PREFETCHES``, ``MAX_OWNERS``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections.abc import Sequence
from typing import Any

from lmcache_client.protocol import ErrorCode, ProtocolError, Request

from ..storage import ChunkKey, TieredStore
from ..supervisor import Supervisor
from .inflight import ByteBudget

logger = logging.getLogger(__name__)

MAX_PREFETCHES = 64
"""Prefetches running at once; a lookup past it is declined."""

MAX_OWNERS = 1024
"""Owners one prefetch keeps; a join past it is not kept (the prefetch runs on for
the owners it has), so lookups of ever new batches cannot grow the set without end."""


Owner = tuple[bytes, bytes]
"""Who joined a prefetch: (the connection's routing id, a digest of the lookup's keys)."""


def owner_of(peer: bytes, keys: Sequence[bytes]) -> Owner:
    """The owner a lookup of ``keys`` on connection ``peer`` joins prefetches as.  A
    cancel must come from the same connection with the same keys (the client sends
    the same batches as its lookup with ``prefetch: true``) to take that join back."""
    digest = hashlib.blake2b(digest_size=16)
    for key in keys:
        digest.update(key)
    return peer, digest.digest()


def _flag(request: Request, name: str) -> bool:
    value = request.fields.get(name)
    if value is None or type(value) is bool:
        return bool(value)
    raise ProtocolError(ErrorCode.BAD_REQUEST, f"'{name}' must be true or false, not {value!r:.40}", request.id)


def prefetch_flag(request: Request) -> bool:
    """The lookup's ``prefetch`` field: absent or nil is False; anything but a bool
    is refused (BAD_REQUEST), as ``all: 1`` is for clear."""
    return _flag(request, "prefetch")


def cancel_flag(request: Request) -> bool:
    """The lookup's ``cancel_prefetch`` field, validated like ``prefetch``; both true
    in one lookup is refused (BAD_REQUEST)."""
    cancel = _flag(request, "cancel_prefetch")
    if cancel and prefetch_flag(request):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'prefetch' and 'cancel_prefetch' in one lookup", request.id)
    return cancel


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
    cancelled: int = 0
    """Prefetches cancelled because every lookup that joined them cancelled (``cancel_prefetch``)."""


@dataclasses.dataclass
class Promoted:
    """What :meth:`Prefetcher.promote_now` did."""

    asked: int = 0
    """Distinct chunks a lower tier held and memory did not."""
    chunks: int = 0
    """Of those, promoted into memory."""
    bytes: int = 0
    """Their payload bytes."""


@dataclasses.dataclass(eq=False)
class _Prefetch:
    keys: list[ChunkKey]
    owners: set[Owner]
    """Lookups that joined it and have not cancelled, each once."""
    task: asyncio.Task[None] | None = None


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
        self._running: dict[ChunkKey, _Prefetch] = {}
        """The prefetch holding each key being prefetched."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def start(self, namespace: str, digests: Sequence[bytes], tiers: Sequence[str | None], owner: Owner) -> None:
        """Promote the leading hits of a lookup (``tiers`` as it answered) that a lower
        tier holds, in the background; returns at once.  ``owner`` (:func:`owner_of`)
        joins the prefetch it starts and each running one holding any of its keys."""
        memory = self.store.memory.name
        keys: list[ChunkKey] = []
        joined: dict[int, _Prefetch] = {}
        for digest, tier in zip(digests, tiers):
            if tier is None:
                break  # only a leading run of hits is of use to the engine
            key = ChunkKey(namespace, digest)
            running = self._running.get(key)
            if running is not None:
                joined[id(running)] = running
            elif tier != memory:
                keys.append(key)
        for running in joined.values():  # this lookup's request shares them: an owner (once)
            if len(running.owners) < MAX_OWNERS:
                running.owners.add(owner)
        if not keys:
            return
        if self._closed or len(self._tasks) >= self.max_running:
            self.counters.declined += not self._closed
            return
        prefetch = _Prefetch(keys, {owner})
        for key in keys:
            self._running[key] = prefetch
        task = prefetch.task = asyncio.get_running_loop().create_task(self._run(prefetch), name="lmcache:prefetch")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel(self, namespace: str, digests: Sequence[bytes], owner: Owner) -> int:
        """``owner`` (:func:`owner_of` of the cancelling lookup) gives up its prefetches:
        it leaves each running prefetch holding any of ``digests`` that it joined; those
        left with no owner are cancelled.  Returns how many.  Prefetches ``owner`` did not
        join are left alone: a cancel only takes back its own request's join."""
        hit: dict[int, _Prefetch] = {}
        for digest in digests:
            running = self._running.get(ChunkKey(namespace, digest))
            if running is not None:
                hit[id(running)] = running
        cancelled = 0
        for prefetch in hit.values():
            if owner not in prefetch.owners:
                continue  # another request's join (or one already cancelled): not this lookup's to give up
            prefetch.owners.discard(owner)
            if not prefetch.owners and prefetch.task is not None and not prefetch.task.done():
                prefetch.task.cancel()
                self._release(prefetch)  # its keys are free for a new prefetch at once
                cancelled += 1
        self.counters.cancelled += cancelled
        return cancelled

    def _release(self, prefetch: _Prefetch) -> None:
        for key in prefetch.keys:
            if self._running.get(key) is prefetch:
                del self._running[key]

    async def _run(self, prefetch: _Prefetch) -> None:
        keys = prefetch.keys
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
                await self._promote(window, nbytes)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # a bug: counted and logged; the lookup was answered already
            self.supervisor.failed("prefetch", err)
        finally:
            self._release(prefetch)

    async def _promote(self, window: list[ChunkKey], nbytes: int) -> list[int]:
        """Promote one window (``nbytes``: what :meth:`_window` sized it at) under the budget."""
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
        return promoted

    async def promote_now(self, namespace: str, digests: Sequence[bytes]) -> Promoted:
        """The ``prefetch`` and ``pin`` ops (server/cacheapi.py): promote every chunk of
        ``digests`` a lower tier holds into memory, window by window under the same
        bounds as a lookup's prefetch, and return when done.  Chunks the budget has no
        room for (or that memory could not take) are left where they are."""
        keys = [ChunkKey(namespace, d) for d in dict.fromkeys(digests)]
        pending = list((await self.store.prefetch_sizes(keys)).items())
        out = Promoted(asked=len(pending))
        while pending and not self._closed:
            window, nbytes = self._window(pending)
            if not window:
                self.counters.declined += 1
                break
            self.counters.prefetches += not out.chunks and len(pending) == out.asked
            del pending[: len(window)]
            promoted = await self._promote(window, nbytes)
            out.chunks += len(promoted)
            out.bytes += sum(promoted)
        return out

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
            "cancelled": c.cancelled,
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
