"""The put flows over shared memory: alloc, copy in, commit.

:func:`put_flow` copies the caller's payloads into the pool, :func:`fill_flow`
hands each reserved slot to a ``fill(i, view)`` callback (one copy in all, the
caller's).  Both first try the staged slots (:mod:`lmcache_client.shm.staged`,
one round trip); otherwise ``alloc`` reserves a slot per chunk under a write
lease, the bytes are written, and ``commit`` makes them visible.  A write lease
whose commit (or an alloc whose grant) never got an answer is remembered as
unsettled and released by the next flow.

Primitives: :func:`put_flow`, :func:`fill_flow`, ``FillFn``, :data:`PUT_MIN_BYTES`.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from .. import calls
from ..errors import ServerError
from ..protocol import PutStatus
from .flows import Ask, Flow, Tell, _in_time, owner
from .get import FlushFn
from .pool import SharedPool
from .staged import _commit_staging, _put_staged, _retire_staged

logger = logging.getLogger("lmcache_client.shm")  # the logger these lines always had

PUT_MIN_BYTES = 256 * 1024
"""Puts smaller than this use payload frames (one round trip instead of two)."""


def _settle(pool: SharedPool) -> Flow:
    """Release write leases whose commit never reached the daemon (it holds their
    slots until it hears their writer is done)."""
    if pool.unsettled:
        leases, pool.unsettled = pool.unsettled, []
        yield Tell(calls.release(leases))


def _alloc(
    pool: SharedPool,
    namespace: str,
    keys: Sequence[bytes],
    sizes: Sequence[int],
    segment: str,
    who: dict[str, int] | None,
    tokens: Any,
) -> Flow:
    """An alloc under a nonce of our choosing: if its reply never comes (a
    timeout, a lost connection), the daemon may still grant it; the nonce goes
    with the unsettled leases, so the next flow (or close) releases that grant."""
    nonce = secrets.randbits(63) or 1
    try:
        grant = yield Ask(calls.alloc(namespace, keys, sizes, segment, who, tokens, nonce=nonce))
    except ServerError:
        raise  # answered: nothing was granted
    except BaseException:
        pool.unsettled.append(nonce)  # the daemon's release takes an alloc's nonce too
        raise
    return grant


def _nbytes(payload: Any) -> int:
    if hasattr(payload, "data_ptr"):
        return int(payload.numel() * payload.element_size())
    return memoryview(payload).nbytes


def _placed(pool: SharedPool, locs: Sequence[Any], sizes: Sequence[int]) -> bool:
    """Whether every slot a grant gave lies inside the segment, is its payload's size
    and overlaps no other (else nothing is written: a daemon that says otherwise
    has a bug, or is not the daemon)."""
    spans = sorted(s for loc, size in zip(locs, sizes) if loc is not None and (s := pool.span(loc, size)) is not None)
    placed = len(spans) == sum(loc is not None for loc in locs)
    if placed and all(a[0] + a[1] <= b[0] for a, b in zip(spans, spans[1:])):
        return True
    logger.warning("the daemon granted pool slots outside its segment or its payloads (%s); nothing written", locs)
    return False


def put_flow(
    pool: SharedPool,
    namespace: str,
    keys: Sequence[bytes],
    payloads: Sequence[Any],
    tokens: calls.TokensArg = None,
) -> Flow:
    """A put over shared memory: into staged slots and one bind, else alloc, copy
    in, commit (asking for staged slots).  One PutStatus per key."""
    yield from _settle(pool)
    pool.began_put()
    sizes = [_nbytes(p) for p in payloads]

    def write(i: int, offset: int, length: int) -> None:
        pool.copy_in(offset, payloads[i])

    done = yield from _put_staged(pool, namespace, keys, sizes, write, tokens)
    if done is not None:
        return done
    yield from _retire_staged(pool)
    grant = yield from _alloc(pool, namespace, keys, sizes, pool.segment, owner(), tokens)
    statuses: list[PutStatus | int] = list(grant.status)
    if grant.lease is None:
        return statuses
    if not _in_time(pool, grant.expires):  # pragma: no cover - needs a stalled client
        yield Tell(calls.release([grant.lease]))
        return [PutStatus.FAILED if loc is not None else s for s, loc in zip(statuses, grant.loc)]
    if not _placed(pool, grant.loc, sizes):
        yield Tell(calls.release([grant.lease]))
        return [PutStatus.FAILED if loc is not None else s for s, loc in zip(statuses, grant.loc)]
    for payload, loc in zip(payloads, grant.loc):
        if loc is not None:
            pool.copy_in(loc[0], payload)
    final = iter((yield from _commit_staging(pool, grant.lease, sizes)))
    return [next(final, PutStatus.FAILED) if loc is not None else s for s, loc in zip(statuses, grant.loc)]


FillFn = Callable[[int, memoryview], None]
"""``fill(i, view)``: write payload ``i`` into ``view`` (writable, exactly its size);
given with a ``flush`` it may write them as late as that call (:data:`~.get.FlushFn`:
after the batch's last ``fill`` and before its bytes are committed or sent)."""


def fill_flow(
    pool: SharedPool,
    namespace: str,
    keys: Sequence[bytes],
    sizes: Sequence[int],
    fill: FillFn,
    tokens: calls.TokensArg = None,
    *,
    flush: FlushFn | None = None,
) -> Flow:
    """A put whose bytes ``fill`` writes straight into the reserved pool slots
    (one copy: the caller's).  ``fill`` runs only for keys given a slot; the
    others keep the status alloc gave them (EXISTS, NO_SPACE, ...).  An
    exception from ``fill`` releases the slots (nothing becomes visible) and
    propagates.  ``flush`` runs after the last ``fill``, before the commit.  Staged
    slots are used as by :func:`put_flow`.  One PutStatus per key."""
    yield from _settle(pool)
    pool.began_put()

    def write(i: int, offset: int, length: int) -> None:
        fill(i, pool.view[offset : offset + length])

    done = yield from _put_staged(pool, namespace, keys, list(sizes), write, tokens, flush=flush)
    if done is not None:
        return done
    yield from _retire_staged(pool)
    grant = yield from _alloc(pool, namespace, keys, list(sizes), pool.segment, owner(), tokens)
    statuses: list[PutStatus | int] = list(grant.status)
    if grant.lease is None:
        return statuses
    if not _in_time(pool, grant.expires):  # pragma: no cover - needs a stalled client
        yield Tell(calls.release([grant.lease]))
        return [PutStatus.FAILED if loc is not None else s for s, loc in zip(statuses, grant.loc)]
    if not _placed(pool, grant.loc, sizes):
        yield Tell(calls.release([grant.lease]))
        return [PutStatus.FAILED if loc is not None else s for s, loc in zip(statuses, grant.loc)]
    try:
        for i, loc in enumerate(grant.loc):
            if loc is not None:
                fill(i, pool.view[loc[0] : loc[0] + loc[1]])
        if flush is not None:
            flush()
    except BaseException:
        yield Tell(calls.release([grant.lease]))
        raise
    final = iter((yield from _commit_staging(pool, grant.lease, list(sizes))))
    return [next(final, PutStatus.FAILED) if loc is not None else s for s, loc in zip(statuses, grant.loc)]
