"""The same-host data path: the daemon's memory pool mapped into this process.

A daemon whose pool lives in a shared-memory segment offers it in its hello
reply (``shm``: path, size, segment token, lease timeout, its monotonic
clock).  A client on the same host maps it (:meth:`SharedPool.open`; a client
elsewhere cannot open the path and keeps using payload frames), then:

- **get**: the reply holds each hit's (offset, length) under a read lease; the
  client copies the bytes straight into their destination (a buffer or a
  torch tensor: one memcpy, or one DMA for a CUDA tensor once the mapping is
  registered with ``cudaHostRegister``) and releases the lease.
- **put**: ``alloc`` reserves a slot per chunk under a write lease, the client
  copies its bytes in, ``commit`` makes them visible.  The commit also asks
  for *staged slots* (``stage``: anonymous pool room sized for the next put,
  under a write lease of its own); a later put whose sizes match them copies
  straight into them and sends one ``bind`` (bind to keys and commit), whose
  reply stages fresh slots in place of those consumed: a stream of puts is
  one round trip each.  A put that does not fit the staged slots (or finds
  their lease near its deadline, or refused) takes alloc+commit, with the
  same results.

Leases end at a deadline on CLOCK_MONOTONIC, which both processes read on one
host.  A copy finished before the deadline (less a safety margin) was made
under a live lease, so the release need not wait for an answer; otherwise the
client asks, and a chunk whose lease lapsed is a miss (its bytes may have
been reused).  When the clocks disagree (a time namespace) every release is
confirmed.

The flows are written once, as generators that yield the calls to make
(:class:`Ask`: wait for the reply, :class:`Tell`: send and do not wait), and
are driven by the sync and asyncio clients alike.

Zero-copy variants for callers that produce or consume the bytes themselves
(an engine adapter gathering KV straight out of its paged cache):
:func:`fill_flow` hands each reserved slot to a ``fill(i, view)`` callback
before committing, :func:`use_flow` hands each leased hit to ``use(i, view)``
before releasing.

Primitives: :class:`SharedPool`, :func:`get_flow`, :func:`put_flow`,
:func:`fill_flow`, :func:`use_flow`, :class:`Ask`, :class:`Tell`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

from . import calls
from .calls import Call
from .errors import ServerError
from .protocol import ErrorCode, PutStatus
from .shmpool import PARALLEL_COPY_MIN_BYTES as PARALLEL_COPY_MIN_BYTES
from .shmpool import SAME_CLOCK_TOLERANCE_S as SAME_CLOCK_TOLERANCE_S
from .shmpool import Mapping as Mapping
from .shmpool import SharedPool as SharedPool
from .shmpool import StagedSlots, _check_tensor, _flat_bytes

logger = logging.getLogger(__name__)

DEADLINE_MARGIN_S = 0.5
"""A copy must end this long before its lease's deadline to count without confirmation."""
PUT_MIN_BYTES = 256 * 1024
"""Puts smaller than this use payload frames (one round trip instead of two)."""


@dataclasses.dataclass(frozen=True)
class Ask:
    """Send ``call`` and wait for its result."""

    call: Call[Any]


@dataclasses.dataclass(frozen=True)
class Tell:
    """Send ``call`` and do not wait for its reply (it is dropped when it comes)."""

    call: Call[Any]


Flow = Generator["Ask | Tell", Any, Any]


REMAP, MISS, RAISE = "remap", "miss", "raise"


def on_failure(err: Exception, fail_open: bool) -> str:
    """What a client does when a shared-memory flow fails with ``err``:
    REMAP (the daemon restarted: map its new segment and try again), MISS
    (answer like a miss: an expired lease, or BUSY/draining/unreachable when
    failing open) or RAISE."""
    from .errors import DaemonUnavailable, ServerError

    if isinstance(err, ServerError):
        if err.code == ErrorCode.STALE_SEGMENT:
            return REMAP
        if err.code == ErrorCode.UNKNOWN_LEASE or (err.code in (ErrorCode.BUSY, ErrorCode.SHUTTING_DOWN) and fail_open):
            return MISS
    elif isinstance(err, DaemonUnavailable) and fail_open:
        return MISS
    return RAISE


_OWNER: tuple[int, dict[str, int] | None] = (0, None)


def owner() -> dict[str, int] | None:
    """This process as a write lease's owner: pid, pid namespace (inode) and start
    time, so the daemon can tell when it is gone (None off Linux)."""
    global _OWNER
    pid = os.getpid()
    if _OWNER[0] != pid:  # computed once per process (again after a fork)
        try:
            pidns = os.stat("/proc/self/ns/pid").st_ino
            with open("/proc/self/stat") as f:
                start = int(f.read().rsplit(")", 1)[1].split()[19])
            _OWNER = (pid, {"pid": pid, "pidns": pidns, "start": start})
        except (OSError, IndexError, ValueError):
            _OWNER = (pid, None)
    return _OWNER[1]


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
) -> Flow:
    """A put in one round trip: write into staged slots, then bind them to the keys.
    None when it cannot be made so (no fitting slots, their lease refused): the
    caller takes alloc+commit, nothing having been stored."""
    if not keys or not pool.staged_puts:
        return None
    taken = _take_staged(pool, sizes)
    if taken is None:
        return None
    staged, slots = taken
    try:
        for i, (offset, length) in enumerate(slots):
            write(i, offset, length)
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


def _commit(pool: SharedPool, lease: int) -> Flow:
    """Commit ``lease``; if the request cannot be sent or answered, remember the lease
    so the next flow releases it."""
    try:
        statuses = yield Ask(calls.commit(lease, pool.segment))
    except BaseException:
        pool.unsettled.append(lease)
        raise
    return statuses


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


def _hit_span(pool: SharedPool, loc: Any) -> tuple[int, int] | None:
    """A hit's location, None (a miss) when it does not lie inside the segment."""
    span = pool.span(loc)
    if span is None:
        logger.warning("the daemon placed a hit outside its segment (%s); a miss", loc)
    return span


def _in_time(pool: SharedPool, expires: float) -> bool:
    return pool.same_clock and time.monotonic() < expires - DEADLINE_MARGIN_S


def _release_read(pool: SharedPool, grant: calls.ShmGrant) -> Flow:
    """End a read lease; returns whether it was live throughout (a copy finished in
    time needs no answer, a late one asks the daemon)."""
    if grant.lease is None:
        return True
    if _in_time(pool, grant.expires):
        yield Tell(calls.release([grant.lease]))
        return True
    (live,) = yield Ask(calls.release([grant.lease]))
    return bool(live)


def get_flow(pool: SharedPool, namespace: str, keys: Sequence[bytes], out: Sequence[Any] | None) -> Flow:
    """A get over shared memory.  Returns one memoryview (a private copy) or
    None per key when ``out`` is None, else copies each hit into ``out[i]`` and
    returns one bool per key."""
    grant = yield Ask(calls.get_shm(namespace, keys, pool.segment))
    frames = iter(grant.payloads)
    results: list[Any] = []
    try:
        for i, (found, loc) in enumerate(zip(grant.found, grant.loc)):
            if not found:
                results.append(None)
            elif loc is None:  # a hit the daemon could not place in the pool: sent as a frame
                results.append(next(frames))
            elif (span := _hit_span(pool, loc)) is None:
                results.append(None)
            elif out is None:
                results.append(pool.read(*span))
            else:
                pool.copy_out(*span, out[i])
                results.append(True)
    except Exception:  # a destination of the wrong size: free the chunks now, not at the lease's expiry
        if grant.lease is not None:
            yield Tell(calls.release([grant.lease]))
        raise
    if not (yield from _release_read(pool, grant)):  # the lease lapsed during the copy: bytes may be torn
        results = [None if loc is not None else r for r, loc in zip(results, grant.loc)]
    if out is None:
        return results
    done = []
    for i, r in enumerate(results):
        if r is None:
            done.append(False)
        elif r is True:
            done.append(True)
        else:  # copied from a frame
            done.append(copy_frame(r, out[i]))
    return done


def copy_frame(buf: Any, dest: Any) -> bool:
    """Copy a received payload into ``dest`` (a tensor, CPU or CUDA, or a writable buffer)."""
    if hasattr(dest, "data_ptr"):
        from .tensors import copy_into

        if dest.device.type == "cpu":
            copy_into(dest, buf)
        else:
            import torch

            _check_tensor(dest, memoryview(buf).nbytes)
            _flat_bytes(dest).copy_(torch.frombuffer(bytearray(buf), dtype=torch.uint8))
        return True
    out = memoryview(dest).cast("B")
    src = memoryview(buf).cast("B")
    if out.nbytes != src.nbytes:
        raise ValueError(f"chunk is {src.nbytes} bytes but the destination holds {out.nbytes}")
    out[:] = src
    return True


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
"""``fill(i, view)``: write payload ``i`` into ``view`` (writable, exactly its size)."""
UseFn = Callable[[int, memoryview], None]
"""``use(i, view)``: consume hit ``i`` from ``view`` (its bytes; do not keep the view)."""


def fill_flow(
    pool: SharedPool,
    namespace: str,
    keys: Sequence[bytes],
    sizes: Sequence[int],
    fill: FillFn,
    tokens: calls.TokensArg = None,
) -> Flow:
    """A put whose bytes ``fill`` writes straight into the reserved pool slots
    (one copy: the caller's).  ``fill`` runs only for keys given a slot; the
    others keep the status alloc gave them (EXISTS, NO_SPACE, ...).  An
    exception from ``fill`` releases the slots (nothing becomes visible) and
    propagates.  Staged slots are used as by :func:`put_flow`.  One PutStatus per key."""
    yield from _settle(pool)
    pool.began_put()

    def write(i: int, offset: int, length: int) -> None:
        fill(i, pool.view[offset : offset + length])

    done = yield from _put_staged(pool, namespace, keys, list(sizes), write, tokens)
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
    except BaseException:
        yield Tell(calls.release([grant.lease]))
        raise
    final = iter((yield from _commit_staging(pool, grant.lease, list(sizes))))
    return [next(final, PutStatus.FAILED) if loc is not None else s for s, loc in zip(statuses, grant.loc)]


def use_flow(
    pool: SharedPool,
    namespace: str,
    keys: Sequence[bytes],
    use: UseFn,
    *,
    nbytes: int | None = None,
    prefix: bool = False,
) -> Flow:
    """A get whose hits ``use`` reads straight out of the leased pool slots.  True
    per key where ``use`` ran on bytes that stayed leased throughout.  With
    ``nbytes`` a hit of another size counts as a miss; with ``prefix`` nothing
    after the first miss is used."""
    grant = yield Ask(calls.get_shm(namespace, keys, pool.segment))
    frames = iter(grant.payloads)
    used = [False] * len(keys)
    try:
        for i, (found, loc) in enumerate(zip(grant.found, grant.loc)):
            view = None
            if found and loc is None:
                view = next(frames)
            elif found and (span := _hit_span(pool, loc)) is not None:
                view = pool.view[span[0] : span[0] + span[1]]
            if view is None or (nbytes is not None and memoryview(view).nbytes != nbytes):
                if prefix:
                    break
                continue
            use(i, memoryview(view))
            used[i] = True
    except BaseException:
        if grant.lease is not None:
            yield Tell(calls.release([grant.lease]))
        raise
    if not (yield from _release_read(pool, grant)):  # the lease lapsed while in use: bytes may have changed
        used = [u and loc is None for u, loc in zip(used, grant.loc)]
        if prefix:
            first_lost = next((i for i, u in enumerate(used) if not u), len(used))
            used = [u and i < first_lost for i, u in enumerate(used)]
    return used


def use_frames(bufs: Sequence[Any], use: UseFn, *, nbytes: int | None = None, prefix: bool = False) -> list[bool]:
    """:func:`use_flow`'s meaning over payload frames (a daemon elsewhere)."""
    used = [False] * len(bufs)
    for i, buf in enumerate(bufs):
        if buf is None or (nbytes is not None and memoryview(buf).nbytes != nbytes):
            if prefix:
                break
            continue
        use(i, memoryview(buf))
        used[i] = True
    return used
