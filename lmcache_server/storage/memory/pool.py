"""The memory pool: one mapping of the configured size, made once at start.

With ``shm_dir`` set (the default is /dev/shm) the pool is a file in that
tmpfs, ``lmcache-pool-<pid>-<token>``, created owner-only (0600) and mapped
shared, so that clients on this host can map it too (see server/shm/leases.py and
docs/protocol.md, "Shared memory").  The random token in the name is what a
client proves it mapped the right segment with; the file is unlinked at close,
and segments left by a daemon that died are removed at the next start.  A
segment left on purpose at a clean stop, with its index (``<name>.warm``,
storage/memory/warmstart.py), is kept for the next daemon to *adopt*: it maps the same
file again (same path, same token) instead of creating one.  Where
the directory is missing, not tmpfs-backed or too small for the pool, the
pool falls back to an anonymous private mapping (one log line; clients then
use payload frames).

Pages are committed as the allocator first reaches them: for a shared pool
:meth:`commit` reserves them in the tmpfs (``posix_fallocate``), so a full
/dev/shm makes a put answer NO_SPACE instead of the daemon dying of SIGBUS;
for an anonymous pool the kernel commits on first touch.  RSS grows with use
up to the configured size and never beyond it.  Where a CUDA device is present
the whole mapping is page-locked with ``cudaHostRegister`` so engines can DMA
from it; elsewhere the daemon logs one line and goes on unpinned.

Primitives: :class:`MemoryPool` (``view``, ``address``, ``pinned``, ``shm_path``,
``shm_token``, ``commit``, ``close``, ``release_lock``), :class:`Segment`,
:func:`remove_stale_segments`.
"""

from __future__ import annotations

import ctypes
import fcntl
import glob
import importlib.util
import logging
import mmap
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_CUDART_NAMES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")


class PinningError(RuntimeError):
    """pin_memory=on was asked for but the pool could not be page-locked."""


SEGMENT_PREFIX = "lmcache-pool-"
SEGMENT_RE = re.compile(r"^lmcache-pool-(\d+)-([0-9a-f]{32})$")
INDEX_SUFFIX = ".warm"
"""A segment with a sibling ``<name>.warm`` was left on purpose by a clean stop."""


@dataclass(frozen=True)
class Segment:
    """An existing pool segment to map again (a warm restart): its path, an open
    descriptor holding its exclusive flock, and its token."""

    path: Path
    fd: int
    token: str


_MEMORY_FILESYSTEMS = ("tmpfs", "shm", "hugetlbfs")


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem ``path`` is on (from /proc/self/mounts), None if unknown."""
    try:
        target = os.path.realpath(path)
        if not os.path.isdir(target):
            return None
        with open("/proc/self/mounts") as mounts:
            entries = [line.split() for line in mounts]
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for fields in entries:
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]):
            best = (len(point), fields[2])
    return best[1] if best else None


def remove_stale_segments(shm_dir: Path) -> int:
    """Unlink pool segments of daemons that are no longer running (this user's only).

    A live daemon holds an exclusive flock on its segment for its whole life
    (pid checks would not work across containers sharing /dev/shm), so a
    segment whose lock can be taken belongs to a daemon that is gone.
    """
    removed = 0
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return 0
    for name in names:
        if SEGMENT_RE.match(name) is None or os.path.exists(shm_dir / (name + INDEX_SUFFIX)):
            continue  # not a segment, or one kept for a warm restart (warmstart.py judges those)
        path = shm_dir / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its daemon is alive
            path.unlink(missing_ok=True)
            removed += 1
        finally:
            os.close(fd)
    if removed:
        logger.info("removed %d shared-memory pool segment(s) left by daemons that died", removed)
    return removed


class MemoryPool:
    def __init__(
        self,
        size: int,
        pin_memory: str = "auto",
        shm_dir: str | os.PathLike[str] | None = None,
        shm_mode: int = 0o600,
        adopt: Segment | None = None,
    ):
        """A pool of ``size`` bytes: in a new segment in ``shm_dir`` (None: an
        anonymous mapping), or, with ``adopt``, in that existing segment (its
        bytes kept)."""
        self.size = size
        self.shm_path: Path | None = None
        self.shm_token = ""
        self._fd = -1
        self._committed = 0
        self._keep_fd = False
        if adopt is not None:
            shared: mmap.mmap | None = self._map_adopted(adopt, shm_mode)
        else:
            shared = self._map_shared(Path(shm_dir), shm_mode) if shm_dir is not None else None
        self._mmap = shared or mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                # Fewer page faults and TLB misses when copying MiB-sized chunks.
                self._mmap.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self.view = memoryview(self._mmap)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))
        self._unregister: object | None = None
        self.pinned = False
        if pin_memory != "off":
            reason = self._try_pin()
            if not self.pinned:
                if pin_memory == "on":
                    self.close()
                    raise PinningError(f"pin_memory=on but the pool could not be page-locked: {reason}")
                logger.info("memory pool not page-locked (%s); GPU clients copy through pageable memory", reason)

    def _map_shared(self, shm_dir: Path, mode: int) -> mmap.mmap | None:
        """The pool as a file in ``shm_dir`` with ``mode`` (0600: owner-only), or
        None (logged) where it cannot be."""
        fs = filesystem_type(shm_dir)
        if fs not in _MEMORY_FILESYSTEMS:
            # A pool file on a disk filesystem would be written back to the disk.
            logger.warning(
                "shared memory off: %s is on %s, not a tmpfs; clients use payload frames",
                shm_dir,
                fs or "no filesystem",
            )
            return None
        remove_stale_segments(shm_dir)
        try:
            free = os.statvfs(shm_dir)
        except OSError as err:
            logger.warning("shared memory off: %s is unusable (%s); clients use payload frames", shm_dir, err)
            return None
        if free.f_bavail * free.f_frsize < self.size:
            logger.warning(
                "shared memory off: %s has %d MiB free, the pool needs %d MiB (docker: raise shm_size); "
                "clients use payload frames",
                shm_dir,
                free.f_bavail * free.f_frsize >> 20,
                self.size >> 20,
            )
            return None
        token = secrets.token_hex(16)
        path = shm_dir / f"{SEGMENT_PREFIX}{os.getpid()}-{token}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        except OSError as err:
            logger.warning("shared memory off: cannot create %s (%s); clients use payload frames", path, err)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # "alive" for remove_stale_segments
            os.fchmod(fd, mode)  # whatever the umask
            os.ftruncate(fd, self.size)
            mapping = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED)
        except OSError as err:
            os.close(fd)
            path.unlink(missing_ok=True)
            logger.warning("shared memory off: cannot map %s (%s); clients use payload frames", path, err)
            return None
        self._fd = fd
        self.shm_path = path
        self.shm_token = token
        who = "owner-only" if mode == 0o600 else f"mode {mode:o}"
        logger.info("memory pool shared with local clients at %s (%s)", path, who)
        return mapping

    def _map_adopted(self, segment: Segment, mode: int) -> mmap.mmap:
        """Map an existing segment again (its pages are there: nothing to commit
        below its size; posix_fallocate keeps existing bytes anyway)."""
        try:
            os.fchmod(segment.fd, mode)
            mapping = mmap.mmap(segment.fd, self.size, flags=mmap.MAP_SHARED)
        except OSError:
            os.close(segment.fd)
            segment.path.unlink(missing_ok=True)
            raise
        self._fd = segment.fd
        self.shm_path = segment.path
        self.shm_token = segment.token
        logger.info("memory pool shared with local clients at %s (adopted)", segment.path)
        return mapping

    @property
    def shared(self) -> bool:
        return self.shm_path is not None

    def ensure_pages(self, offset: int, size: int) -> bool:
        """Make sure the pages of [offset, offset+size) exist; False when the
        backing tmpfs is full (the caller answers NO_SPACE).  Pages below the
        highest extent ever handed out are committed already."""
        end = offset + size
        if self._fd < 0 or end <= self._committed:
            return True
        try:
            os.posix_fallocate(self._fd, self._committed, end - self._committed)
        except OSError as err:
            logger.warning("shared memory pool: cannot commit %d bytes (%s)", end - self._committed, err)
            return False
        self._committed = end
        return True

    def _try_pin(self) -> str:
        if not glob.glob("/dev/nvidia[0-9]*"):
            return "no CUDA device on this host"
        for name in _CUDART_NAMES:
            try:
                cudart = ctypes.CDLL(name)
            except OSError:
                continue
            rc = cudart.cudaHostRegister(ctypes.c_void_p(self.address), ctypes.c_size_t(self.size), 0)
            if rc == 0:
                self._unregister = lambda lib=cudart: lib.cudaHostUnregister(ctypes.c_void_p(self.address))
                self.pinned = True
                logger.info("memory pool page-locked with cudaHostRegister (%s)", name)
                return ""
            return f"cudaHostRegister returned error {rc}"
        if importlib.util.find_spec("torch") is not None:
            import torch

            if torch.cuda.is_available():
                rt = torch.cuda.cudart()  # type: ignore[no-untyped-call]
                rc = int(rt.cudaHostRegister(self.address, self.size, 0))
                if rc == 0:
                    self._unregister = lambda: rt.cudaHostUnregister(self.address)
                    self.pinned = True
                    logger.info("memory pool page-locked with cudaHostRegister (torch)")
                    return ""
                return f"cudaHostRegister returned error {rc}"
        return "no CUDA runtime found (libcudart or torch with CUDA)"

    def close(self, keep_segment: bool = False) -> None:
        """Unmap.  The segment file is unlinked, unless ``keep_segment`` (a warm
        restart: its index was written beside it); then its lock is held until
        :meth:`release_lock`, so that no other daemon adopts it while this
        process may still write into it."""
        if self._unregister is not None:
            self._unregister()  # type: ignore[operator]
            self._unregister = None
        if self.shm_path is not None and not keep_segment:
            # Clients keep their own mappings; the name goes now, the memory with the last one.
            self.shm_path.unlink(missing_ok=True)
        self.shm_path = None
        self._keep_fd = keep_segment and self._fd >= 0
        if self._fd >= 0 and not self._keep_fd:
            os.close(self._fd)
            self._fd = -1
        try:
            self.view.release()
            self._mmap.close()
        except BufferError:
            # A zero-copy send still references the pool; the mapping goes with the process.
            logger.debug("memory pool still referenced at close")

    def release_lock(self) -> None:
        """Let another daemon adopt a segment kept by ``close(keep_segment=True)``
        (call it last, once no thread of this process can write into the pool)."""
        if self._keep_fd and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._keep_fd = False
