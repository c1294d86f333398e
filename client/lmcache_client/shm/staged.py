"""Staged slots: a stream of shared-memory puts in one round trip each.

A commit (while puts stream) also asks for anonymous pool room sized for the
next put, under a write lease of its own; a later put whose sizes match copies
straight into those slots and sends one ``bind`` (bind to keys and commit),
whose reply stages fresh slots in place of those consumed.  A put that does not
fit them (or finds their lease near its deadline, or refused) takes
alloc+commit instead (:mod:`lmcache_client.shm.put`), with the same results.

Primitives: :func:`_put_staged` (a put into staged slots, None when it cannot
be made so), :func:`_retire_staged`, :func:`_commit_staging` (commit, asking
for slots for the next put), :func:`parting` (what a closing client releases).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from .. import calls
from ..errors import ServerError
from ..protocol import ErrorCode, PutStatus
from .flows import Ask, Flow, Tell, _in_time, owner
from .pool import SharedPool, StagedSlots


def parting(pool: SharedPool) -> list[int]:
    """Leases to release before this client lets go of the pool (closing): its idle
    staged slots and any unsettled write leases."""
    leases, pool.unsettled = pool.unsettled, []
    staged = pool.staged
    if staged is not None and not staged.busy:
        pool.staged = None
        if staged.pid == os.getpid():
            leases.append(staged.lease)
    return leases


def _take_staged(pool: SharedPool, sizes: Sequence[int]) -> tuple[StagedSlots, list[tuple[int, int]]] | None:
    """Staged slots of exactly ``sizes`` (reserved for this put), or None."""
    staged = pool.staged
    if staged is None or staged.busy or staged.pid != os.getpid() or not _in_time(pool, staged.expires):
        return None
    free = list(staged.free)
    picked = []
    for size in sizes:
        at = next((j for j, slot in enumerate(free) if pool.span(slot, size) is not None), None)
        if at is None:
            return None
        picked.append(free.pop(at))
    staged.free = free
    staged.busy = True
    return staged, picked


def _retire_staged(pool: SharedPool) -> Flow:
    """Let go of staged slots that did not fit a put (or whose lease is near its
    deadline), unless a put is using them; the commit stages new ones."""
    staged = pool.staged
    if staged is not None and staged.pid != os.getpid():
        pool.staged = None  # the parent's, in a forked child: not this process's to release
    elif staged is not None and not staged.busy:
        pool.staged = None
        yield Tell(calls.release([staged.lease]))


WriteFn = Callable[[int, int, int], None]
"""``write(i, offset, length)``: put payload ``i`` into the pool slot at ``offset``."""


def _put_staged(
    pool: SharedPool,
    namespace: str,
    keys: Sequence[bytes],
    sizes: Sequence[int],
    write: WriteFn,
    tokens: calls.TokensArg,
    *,
    flush: Callable[[], None] | None = None,
) -> Flow:
    """A put in one round trip: write into staged slots, then bind them to the keys.
    None when it cannot be made so (no fitting slots, their lease refused): the
    caller takes alloc+commit, nothing having been stored.  ``flush``: runs after the
    last ``write``, before the bind (a fill that writes its batch at once)."""
    if not keys or not pool.staged_puts:
        return None
    taken = _take_staged(pool, sizes)
    if taken is None:
        return None
    staged, slots = taken
    try:
        for i, (offset, length) in enumerate(slots):
            write(i, offset, length)
        if flush is not None:
            flush()
    except BaseException:  # the slots stay staged, nothing became visible
        staged.free += slots
        staged.busy = False
        raise
    try:
        bound = yield Ask(calls.bind(namespace, keys, [o for o, _ in slots], staged.lease, pool.segment, tokens))
    except ServerError as err:
        staged.busy = False
        if err.code in _NOTHING_CONSUMED:
            staged.free += slots  # refused before it touched them (FORBIDDEN, BAD_REQUEST)
            raise
        if err.code not in (ErrorCode.UNKNOWN_LEASE, ErrorCode.STALE_SEGMENT):
            # INTERNAL or anything else: which slots it consumed is unknown (a committed
            # chunk's slot must never be written again): let the lease go, as unanswered.
            if pool.staged is staged:
                pool.staged = None
            pool.unsettled.append(staged.lease)
            raise
        if pool.staged is staged:  # expired (or the daemon restarted): nothing was stored
            pool.staged = None
        if err.code == ErrorCode.STALE_SEGMENT:
            raise
        return None
    except BaseException:  # unanswered: which slots it consumed is unknown; let the lease go
        staged.busy = False
        if pool.staged is staged:
            pool.staged = None
        pool.unsettled.append(staged.lease)
        raise
    staged.busy = False
    staged.free += [slot for slot, st in zip(slots, bound.status) if st != PutStatus.STORED] + bound.fresh
    staged.expires = bound.expires
    pool.binds += 1
    return bound.status


def _commit_staging(pool: SharedPool, lease: int, sizes: Sequence[int]) -> Flow:
    """Commit ``lease``; when this client holds no staged slots and puts stream
    (the previous one began less than half a lease timeout before this one), ask
    for slots of ``sizes`` for its next put in the same round trip.  (A one-off
    put stages nothing: staged room is held until used, released, or its
    lease lapses and its writer is seen done.)"""
    if pool.staged is not None or not pool.same_clock or not pool.streaming or not pool.staged_puts:
        return (yield from _commit(pool, lease))
    try:
        statuses, staged = yield Ask(calls.commit_staging(lease, pool.segment, sizes, owner()))
    except BaseException:
        pool.unsettled.append(lease)
        raise
    if staged is not None:
        if pool.staged is None:
            pool.staged = StagedSlots(staged.lease, list(staged.slots), staged.expires)
        else:  # another put staged meanwhile
            yield Tell(calls.release([staged.lease]))
    return statuses


_NOTHING_CONSUMED = frozenset(
    {ErrorCode.BAD_REQUEST, ErrorCode.FORBIDDEN, ErrorCode.MALFORMED, ErrorCode.TOO_LARGE, ErrorCode.BUSY}
)
"""Errors a bind gets only before it touches any slot (its checks, its admission)."""


def _commit(pool: SharedPool, lease: int) -> Flow:
    """Commit ``lease``; if the request cannot be sent or answered, remember the lease
    so the next flow releases it."""
    try:
        statuses = yield Ask(calls.commit(lease, pool.segment))
    except BaseException:
        pool.unsettled.append(lease)
        raise
    return statuses
