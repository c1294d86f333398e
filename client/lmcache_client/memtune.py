"""glibc malloc tuning for processes that receive large ZeroMQ messages.

libzmq allocates each received message with malloc.  glibc serves blocks over
its mmap threshold (at most 32 MiB) with a fresh mmap and returns them with
munmap, so every 32 MiB chunk received page-faults its whole buffer again:
2-3x slower receives.  :func:`tune_malloc` keeps large blocks on the heap and
the heap from shrinking, so receive buffers are reused; the cost is that
freed memory stays with the process (bounded by the in-flight budget).

libzmq allocates in its own I/O thread, which glibc gives its own arena, and
an emptied arena heap is unmapped whatever the trim threshold says; so the
tuning also caps the process at one arena.  That only affects threads that
have not allocated yet: call it before creating any ZeroMQ context (the daemon
does so first thing).  ``MALLOC_ARENA_MAX=1`` in the environment has the same
effect from the start.

Primitive: :func:`tune_malloc` (no-op, returning False, off glibc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def tune_malloc() -> bool:
    """Disable mmap-backed malloc blocks, heap trimming and extra arenas; True if applied."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = (
        bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)) and bool(mallopt(_M_ARENA_MAX, 1))
    )
    if not ok:
        logger.debug("mallopt refused the tuning")
    return ok
