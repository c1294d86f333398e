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
  copies its bytes in, ``commit`` makes them visible.

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

import concurrent.futures
import ctypes
import dataclasses
import logging
import mmap
import os
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

from . import calls
from .calls import Call
from .protocol import ErrorCode, PutStatus

logger = logging.getLogger(__name__)

DEADLINE_MARGIN_S = 0.5
"""A copy must end this long before its lease's deadline to count without confirmation."""
SAME_CLOCK_TOLERANCE_S = 1.0
"""The daemon's clock reading in hello may differ from ours by at most this much
(it includes the round trip) for the two to count as the same clock."""
PUT_MIN_BYTES = 256 * 1024
"""Puts smaller than this use payload frames (one round trip instead of two)."""
PARALLEL_COPY_MIN_BYTES = 4 << 20
"""A copy at least this large is split over ``copy_threads`` threads."""


@dataclasses.dataclass(frozen=True)
class Ask:
    """Send ``call`` and wait for its result."""

    call: Call[Any]


@dataclasses.dataclass(frozen=True)
class Tell:
    """Send ``call`` and do not wait for its reply (it is dropped when it comes)."""

    call: Call[Any]


Flow = Generator["Ask | Tell", Any, Any]


class SharedPool:
    """This process's mapping of a daemon's pool segment."""

    def __init__(
        self, path: str, size: int, segment: str, lease_timeout_s: float, same_clock: bool, copy_threads: int = 1
    ):
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise OSError(f"{path} is {actual} bytes, the daemon said {size}")
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.path = path
        self.size = size
        self.segment = segment
        self.lease_timeout_s = lease_timeout_s
        self.same_clock = same_clock
        self.view = memoryview(self._mmap)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))
        self._cuda_registered = False
        self.copy_threads = max(1, copy_threads)
        self._copiers: concurrent.futures.ThreadPoolExecutor | None = None
        self.unsettled: list[int] = []
        """Write leases whose commit may not have reached the daemon (see _commit)."""

    @classmethod
    def open(cls, offer: Any, copy_threads: int = 1) -> SharedPool | None:
        """Map the segment a hello reply offers; None when this process cannot
        (another host, another user, no shared /dev/shm): use payload frames."""
        if not isinstance(offer, dict):
            return None
        try:
            same_clock = abs(float(offer["clock"]) - time.monotonic()) < SAME_CLOCK_TOLERANCE_S
            return cls(
                str(offer["path"]),
                int(offer["size"]),
                str(offer["segment"]),
                float(offer["lease_timeout_s"]),
                same_clock,
                copy_threads,
            )
        except (OSError, KeyError, TypeError, ValueError) as err:
            logger.info("daemon's shared memory not mappable here (%s); using payload frames", err)
            return None

    def close(self) -> None:
        if self._copiers is not None:
            self._copiers.shutdown(wait=True)
            self._copiers = None
        if self._cuda_registered:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.address)  # type: ignore[no-untyped-call]
            self._cuda_registered = False
        try:
            self.view.release()
            self._mmap.close()
        except BufferError:  # pragma: no cover - a caller still holds a view
            logger.debug("shared pool still referenced at close")

    def _check(self, offset: int, length: int) -> None:
        if not (offset >= 0 and length > 0 and offset + length <= self.size):
            raise ValueError(f"location ({offset}, {length}) outside the {self.size}-byte pool")

    # -- copies --------------------------------------------------------------------
    def copy_out(self, offset: int, length: int, dest: Any) -> None:
        """Copy pool bytes into ``dest``: a writable buffer or a contiguous torch
        tensor (CPU, or CUDA: a DMA from the registered mapping) of ``length`` bytes."""
        self._check(offset, length)
        if hasattr(dest, "data_ptr"):
            _check_tensor(dest, length)
            if dest.device.type == "cpu":
                self._memmove(dest.data_ptr(), self.address + offset, length)
            else:
                _flat_bytes(dest).copy_(self._host_tensor(offset, length))
            return
        out = memoryview(dest).cast("B")
        if out.nbytes != length:
            raise ValueError(f"chunk is {length} bytes but the destination holds {out.nbytes}")
        address = _address(out)
        if address is None:
            out[:] = self.view[offset : offset + length]
        else:
            self._memmove(address, self.address + offset, length)

    def read(self, offset: int, length: int) -> memoryview:
        """A private copy of pool bytes (one memcpy)."""
        self._check(offset, length)
        return memoryview(bytes(self.view[offset : offset + length]))

    def copy_in(self, offset: int, src: Any) -> None:
        """Copy ``src`` (a buffer, or a CPU/CUDA tensor: stored by value, in
        contiguous order) into the pool."""
        if hasattr(src, "data_ptr"):
            src = src.detach().contiguous()
            length = src.numel() * src.element_size()
            self._check(offset, length)
            _check_tensor(src, length)
            if src.device.type == "cpu":
                self._memmove(self.address + offset, src.data_ptr(), length)
            else:
                self._host_tensor(offset, length).copy_(_flat_bytes(src))
            return
        data = memoryview(src).cast("B")
        self._check(offset, data.nbytes)
        address = _address(src)
        if address is None:
            self.view[offset : offset + data.nbytes] = data
        else:
            self._memmove(self.address + offset, address, data.nbytes)

    def _memmove(self, dst: int, src: int, length: int) -> None:
        """memcpy, split over ``copy_threads`` threads when large (ctypes drops
        the GIL during each piece, so the pieces really run in parallel)."""
        threads = self.copy_threads
        if threads == 1 or length < PARALLEL_COPY_MIN_BYTES:
            ctypes.memmove(dst, src, length)
            return
        if self._copiers is None:
            self._copiers = concurrent.futures.ThreadPoolExecutor(threads - 1, thread_name_prefix="lmcache-copy")
        piece = (length // threads + 4095) // 4096 * 4096  # page-aligned pieces
        starts = list(range(piece, length, piece))
        futures = [self._copiers.submit(ctypes.memmove, dst + at, src + at, min(piece, length - at)) for at in starts]
        ctypes.memmove(dst, src, min(piece, length))
        for future in futures:
            future.result()

    def register_cuda(self) -> bool:
        """Page-lock the mapping (``cudaHostRegister``) so CUDA copies to and from it
        are DMA; True when registered (now or before)."""
        if not self._cuda_registered:
            import torch

            rc = int(torch.cuda.cudart().cudaHostRegister(self.address, self.size, 0))  # type: ignore[no-untyped-call]
            self._cuda_registered = rc == 0
            if rc != 0:
                logger.info("cudaHostRegister of the shared pool failed (%d); copies go through pageable memory", rc)
        return self._cuda_registered

    def _host_tensor(self, offset: int, length: int) -> Any:
        """A uint8 CPU tensor over pool bytes, page-locked for DMA on first use."""
        import torch

        self.register_cuda()
        return torch.frombuffer(self.view[offset : offset + length], dtype=torch.uint8)


def _address(buf: Any) -> int | None:
    """The address of a contiguous buffer's bytes, None when it cannot be had
    without a copy (then the copy stays a single-threaded slice assignment)."""
    if isinstance(buf, bytes):
        return ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value if buf else None
    try:
        view = memoryview(buf)
        if view.readonly or not view.c_contiguous or view.nbytes == 0:
            return None
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return None


class Mapping:
    """A client's state of the shared-memory path: not asked yet, not offered or
    not mappable (``pool`` None), or mapped.  Shared by the sync and asyncio clients."""

    def __init__(self, copy_threads: int):
        self.copy_threads = copy_threads
        self.pool: SharedPool | None = None
        self.probed = False

    def adopt(self, offer: Any) -> SharedPool | None:
        """Map what a hello reply offers (once: a concurrent second probe keeps the first)."""
        if not self.probed:
            self.probed = True
            self.pool = SharedPool.open(offer, self.copy_threads)
        return self.pool

    def drop(self) -> None:
        """Unmap; the next data op asks the daemon again (after a restart: a new segment)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self.probed = False


def _check_tensor(tensor: Any, length: int) -> None:
    if not tensor.is_contiguous():
        raise ValueError("shared-memory copies need contiguous tensors")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes != length:
        raise ValueError(f"chunk is {length} bytes but the tensor holds {nbytes}")


def _flat_bytes(tensor: Any) -> Any:
    import torch

    return tensor.detach().reshape(-1).view(torch.uint8)


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


def _settle(pool: SharedPool) -> Flow:
    """Release write leases whose commit never reached the daemon (it holds their
    slots until it hears their writer is done)."""
    if pool.unsettled:
        leases, pool.unsettled = pool.unsettled, []
        yield Tell(calls.release(leases))


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
            elif out is None:
                results.append(pool.read(loc[0], loc[1]))
            else:
                pool.copy_out(loc[0], loc[1], out[i])
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
    """A put over shared memory: alloc, copy in, commit.  One PutStatus per key."""
    yield from _settle(pool)
    sizes = [_nbytes(p) for p in payloads]
    grant = yield Ask(calls.alloc(namespace, keys, sizes, pool.segment, owner(), tokens))
    statuses: list[PutStatus | int] = list(grant.status)
    if grant.lease is None:
        return statuses
    if not _in_time(pool, grant.expires):  # pragma: no cover - needs a stalled client
        yield Tell(calls.release([grant.lease]))
        return [PutStatus.FAILED if loc is not None else s for s, loc in zip(statuses, grant.loc)]
    for payload, loc in zip(payloads, grant.loc):
        if loc is not None:
            pool.copy_in(loc[0], payload)
    final = iter((yield from _commit(pool, grant.lease)))
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
    propagates.  One PutStatus per key."""
    yield from _settle(pool)
    grant = yield Ask(calls.alloc(namespace, keys, list(sizes), pool.segment, owner(), tokens))
    statuses: list[PutStatus | int] = list(grant.status)
    if grant.lease is None:
        return statuses
    if not _in_time(pool, grant.expires):  # pragma: no cover - needs a stalled client
        yield Tell(calls.release([grant.lease]))
        return [PutStatus.FAILED if loc is not None else s for s, loc in zip(statuses, grant.loc)]
    try:
        for i, loc in enumerate(grant.loc):
            if loc is not None:
                fill(i, pool.view[loc[0] : loc[0] + loc[1]])
    except BaseException:
        yield Tell(calls.release([grant.lease]))
        raise
    final = iter((yield from _commit(pool, grant.lease)))
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
            if found:
                view = next(frames) if loc is None else pool.view[loc[0] : loc[0] + loc[1]]
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
