"""The vocabulary of the shared-memory flows (:mod:`lmcache_client.shm`).

A flow is a generator that yields the calls to make and is driven by the sync
and asyncio clients alike: :class:`Ask` (wait for the reply) or :class:`Tell`
(send and do not wait).  Here too what every flow shares: what a client does
when a flow fails (:func:`on_failure`), this process as a write lease's owner
(:func:`owner`), and whether a lease's deadline leaves time to count a copy
without confirmation (:data:`DEADLINE_MARGIN_S`).

Primitives: :class:`Ask`, :class:`Tell`, ``Flow``, :func:`on_failure`
(``REMAP``, ``MISS``, ``RAISE``), :func:`owner`, :data:`DEADLINE_MARGIN_S`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Generator
from typing import Any

from ..calls import Call
from ..protocol import ErrorCode
from .pool import SharedPool

DEADLINE_MARGIN_S = 0.5
"""A copy must end this long before its lease's deadline to count without confirmation."""


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
    from ..errors import DaemonUnavailable, ServerError

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


def _in_time(pool: SharedPool, expires: float) -> bool:
    return pool.same_clock and time.monotonic() < expires - DEADLINE_MARGIN_S
