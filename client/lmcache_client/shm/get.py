"""The get flows over shared memory: a read lease, then the bytes straight out of the pool.

The reply holds each hit's (offset, length) under a read lease; :func:`get_flow`
copies the bytes into their destination (a buffer or a torch tensor: one
memcpy, or one DMA for a CUDA tensor once the mapping is registered), and
:func:`use_flow` hands each leased hit to a ``use(i, view)`` callback; then the
lease is released.  A copy finished before the lease's deadline (less a margin)
needs no answer; a late one asks, and a chunk whose lease lapsed is a miss.

Primitives: :func:`get_flow`, :func:`use_flow`, ``UseFn``, ``FlushFn``, and over payload
frames (a daemon elsewhere) :func:`copy_frame`, :func:`use_frames`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from .. import calls
from .flows import Ask, Flow, Tell, _in_time
from .pool import SharedPool, _check_tensor, _flat_bytes

logger = logging.getLogger("lmcache_client.shm")  # the logger these lines always had

UseFn = Callable[[int, memoryview], None]
"""``use(i, view)``: consume hit ``i`` from ``view`` (its bytes; do not keep the view past
the call, or, where the caller passes a ``flush``, past that: see :data:`FlushFn`)."""

FlushFn = Callable[[], None]
"""``flush()``: given beside a ``use`` (or a ``fill``), called once after its last call and
before the views are released (a lease, the reply's frames) or committed, so the callback
may defer reading (writing) the views it was given until then: a batch of copies."""


def _hit_span(pool: SharedPool, loc: Any) -> tuple[int, int] | None:
    """A hit's location, None (a miss) when it does not lie inside the segment."""
    span = pool.span(loc)
    if span is None:
        logger.warning("the daemon placed a hit outside its segment (%s); a miss", loc)
    return span


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
        from ..tensors import copy_into

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


def use_flow(
    pool: SharedPool,
    namespace: str,
    keys: Sequence[bytes],
    use: UseFn,
    *,
    nbytes: int | None = None,
    prefix: bool = False,
    flush: FlushFn | None = None,
) -> Flow:
    """A get whose hits ``use`` reads straight out of the leased pool slots.  True
    per key where ``use`` ran on bytes that stayed leased throughout.  With
    ``nbytes`` a hit of another size counts as a miss; with ``prefix`` nothing
    after the first miss is used; ``flush`` runs before the lease is released."""
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
        if flush is not None:
            flush()
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


def use_frames(
    bufs: Sequence[Any], use: UseFn, *, nbytes: int | None = None, prefix: bool = False, flush: FlushFn | None = None
) -> list[bool]:
    """:func:`use_flow`'s meaning over payload frames (a daemon elsewhere)."""
    used = [False] * len(bufs)
    for i, buf in enumerate(bufs):
        if buf is None or (nbytes is not None and memoryview(buf).nbytes != nbytes):
            if prefix:
                break
            continue
        use(i, memoryview(buf))
        used[i] = True
    if flush is not None:
        flush()
    return used
