"""glibc malloc tuning for processes that receive large ZeroMQ messages.

libzmq allocates each received message with malloc.  glibc serves blocks over
its mmap threshold (at most 32 MiB) with a fresh mmap and returns them with
munmap, so every 32 MiB chunk received page-faults its whole buffer again:
2-3x slower receives.  :func:`tune_malloc` keeps large blocks on the heap and
the heap from shrinking, so receive buffers are reused; the cost is that
freed memory stays with the process (bounded by the in-flight budget).

Primitive: :func:`tune_malloc` (no-op, returning False, off glibc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def tune_malloc() -> bool:
    """Disable mmap-backed malloc blocks and heap trimming; True if applied."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    if not ok:
        logger.debug("mallopt refused the tuning")
    return ok
