"""Exclusive locks that mark a path as one daemon's for the daemon's whole life.

One mechanism for every "one daemon per X": the spill directory
(``storage/disk``, ``<root>/lmcache.lock``) and each ``ipc://`` endpoint the
daemon binds (``server/endpointlocks.py``, ``<socket path>.lock``).  The lock is
an exclusive ``flock`` on a small file, taken without waiting: a second daemon
sees it held and refuses to start.  The kernel drops it when the process dies,
so a crash never leaves a stale lock behind; the file itself stays (removing it
would let two processes lock two different files of one name).

Primitives: :func:`hold_lock`, :class:`LockHeld`.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

__all__ = ["LockHeld", "hold_lock"]


class LockHeld(Exception):
    """Another process holds the lock."""


def hold_lock(path: Path) -> int:
    """Take the exclusive lock on ``path`` (created 0600 if missing, never through a
    symlink) and return its descriptor; the lock lasts until it is closed or the
    process exits.

    Raises :class:`LockHeld` if another process holds it, ``OSError`` if the file
    cannot be opened (its directory missing, or another user's file)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LockHeld(str(path)) from None
    except OSError:
        os.close(fd)
        raise
    return fd
