"""This process's mapping of a daemon's shared-memory pool (see the package docstring for the flows).

:class:`SharedPool`: the mapped segment and the copies in and out of it (split
over threads when large, DMA for CUDA tensors once registered);
:class:`Mapping`: a client's state of the shared-memory path;
:class:`StagedSlots`: the staged slots this process holds for its next put.

The client trusts no daemon with its files: whoever answers hello (under
``auth: none``, any local user who bound the port) names the file to map, so
only a pool segment is mapped (:func:`open_segment`: the daemon's name for it,
``lmcache-pool-<pid>-<token>`` with the announced token, opened without
following a symlink, a regular file with one link on tmpfs or hugetlbfs, of the
announced size, locked by a live daemon).  Anything else is refused (one warning) and the client uses
payload frames.  Every location the daemon then gives is checked against the
segment (:meth:`SharedPool.span`) before a byte is copied.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import dataclasses
import fcntl
import hmac
import logging
import mmap
import os
import re
import stat
import time
from typing import Any

logger = logging.getLogger("lmcache_client.shmpool")  # the logger these lines always had

SAME_CLOCK_TOLERANCE_S = 1.0
"""The daemon's clock reading in hello may differ from ours by at most this much
(it includes the round trip) for the two to count as the same clock."""
PARALLEL_COPY_MIN_BYTES = 4 << 20
"""A copy at least this large is split over ``copy_threads`` threads."""
SEGMENT_NAME = re.compile(r"lmcache-pool-[0-9]+-([0-9a-f]{32})")
"""How a daemon names its pool segment (the daemon's storage/memory/pool.py): the token is the announced ``segment``."""
TMPFS_MAGIC = 0x01021994
HUGETLBFS_MAGIC = 0x958458F6
_MEMORY_FS = (TMPFS_MAGIC, HUGETLBFS_MAGIC)


class SegmentRefused(OSError):
    """The file a hello names is not a daemon's pool segment: it is not mapped."""


_refused: set[str] = set()
"""Paths already refused with a warning (each is logged once per process)."""


def _fs_type(fd: int) -> int | None:
    """The filesystem magic (``statfs.f_type``) of an open file, None when unknown."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fstatfs = libc.fstatfs
    except (OSError, AttributeError):
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first
    if fstatfs(fd, buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def open_segment(path: str, size: int, token: str) -> int:
    """A read-write descriptor of the pool segment a hello names; raises
    :class:`SegmentRefused` unless ``path`` is one: named like the daemon's
    segments with ``token``, not a symlink, a regular file with a single link on
    tmpfs or hugetlbfs, of exactly ``size`` bytes, and locked: a daemon holds an
    exclusive flock on its segment while it runs, so a segment no daemon holds
    (one kept for a warm restart, whose bytes the next daemon adopts) is not
    written at the word of whoever answered hello meanwhile."""
    name = SEGMENT_NAME.fullmatch(os.path.basename(path))
    if name is None or not hmac.compare_digest(name.group(1), token):
        raise SegmentRefused(f"{path} is not a pool segment with the announced token")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as err:
        if os.path.islink(path):
            raise SegmentRefused(f"{path} is a symlink, not a pool segment") from err
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            raise SegmentRefused(f"{path} is not a pool segment (not a regular file with a single link)")
        if _fs_type(fd) not in _MEMORY_FS:
            raise SegmentRefused(f"{path} is not a pool segment (not on tmpfs or hugetlbfs)")
        if info.st_size != size:
            raise SegmentRefused(f"{path} is {info.st_size} bytes, the daemon said {size}")
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released when fd closes
        except BlockingIOError:
            pass  # held by its daemon, as it should be
        else:
            raise SegmentRefused(f"{path} is a pool segment that no running daemon holds")
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclasses.dataclass(eq=False)
class StagedSlots:
    """Staged slots: pool room under a write lease, bound to no key until a bind."""

    lease: int
    free: list[tuple[int, int]]
    """(offset, length) of the slots not in use by a put now."""
    expires: float
    busy: bool = False
    """A put is writing into (or binding) some of its slots: one put at a time, so a
    late bind (which frees the lease's room) never races another put's copy."""
    pid: int = dataclasses.field(default_factory=os.getpid)
    """The process they were staged for (a forked child must not write into them too)."""


class SharedPool:
    """This process's mapping of a daemon's pool segment."""

    def __init__(
        self,
        path: str,
        size: int,
        segment: str,
        lease_timeout_s: float,
        same_clock: bool,
        copy_threads: int = 1,
        staged_puts: bool = True,
    ):
        fd = open_segment(path, size, segment)
        try:
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
        self.staged_puts = staged_puts
        """Use staged slots for puts (False: every put is alloc+commit)."""
        self.staged: StagedSlots | None = None
        """This process's staged slots in this pool (see put_flow)."""
        self.binds = 0
        """Puts made into staged slots (one round trip each)."""
        self.last_put = float("-inf")
        """When the last put over this pool began (CLOCK_MONOTONIC): staged slots are
        asked for only while puts stream (see _commit_staging)."""
        self.streaming = False

    @classmethod
    def open(cls, offer: Any, copy_threads: int = 1, staged_puts: bool = True) -> SharedPool | None:
        """Map the segment a hello reply offers; None when this process cannot
        (another host, another user, no shared /dev/shm) or will not (the file
        named is not a pool segment: :func:`open_segment`): use payload frames."""
        if not isinstance(offer, dict):
            return None
        try:
            path, size, segment = offer["path"], offer["size"], offer["segment"]
            if not isinstance(path, str) or type(size) is not int or size <= 0 or not isinstance(segment, str):
                raise TypeError(f"malformed shared-memory offer {offer!r}")
            same_clock = abs(float(offer["clock"]) - time.monotonic()) < SAME_CLOCK_TOLERANCE_S
            return cls(path, size, segment, float(offer["lease_timeout_s"]), same_clock, copy_threads, staged_puts)
        except SegmentRefused as err:
            if str(offer.get("path")) not in _refused:
                _refused.add(str(offer.get("path")))
                logger.warning("the daemon offered a file that is not a pool segment (%s); using payload frames", err)
            else:
                logger.debug("refused the daemon's shared memory again (%s)", err)
            return None
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

    def began_put(self) -> None:
        """Note a put starting now (``streaming``: the one before began recently)."""
        now = time.monotonic()
        self.streaming = now - self.last_put < self.lease_timeout_s / 2
        self.last_put = now

    def span(self, loc: Any, length: int | None = None) -> tuple[int, int] | None:
        """A location the daemon gave as (offset, length), None unless it is two
        ints lying inside the segment (and, with ``length``, exactly that long)."""
        if not isinstance(loc, (list, tuple)) or len(loc) != 2:
            return None
        offset, size = loc
        if type(offset) is not int or type(size) is not int or (length is not None and size != length):
            return None
        if offset < 0 or size < 0 or offset + size > self.size:
            return None
        return offset, size

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

    def __init__(self, copy_threads: int, staged_puts: bool = True):
        self.copy_threads = copy_threads
        self.staged_puts = staged_puts
        self.pool: SharedPool | None = None
        self.probed = False

    def adopt(self, offer: Any) -> SharedPool | None:
        """Map what a hello reply offers (once: a concurrent second probe keeps the first)."""
        if not self.probed:
            self.probed = True
            self.pool = SharedPool.open(offer, self.copy_threads, self.staged_puts)
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
