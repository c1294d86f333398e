"""The daemon's state files: a private directory, and files no other user can plant,
read or redirect.

What a clean stop leaves for the next start (the Redis removals it still owed, the
announced chunks' token ids, the installation's id) must not sit where another local
user may write.  In a sticky, world-writable directory such as ``/dev/shm`` anyone can
create a file under a name they can compute (a pending-removals file that clears every
namespace in the shared Redis), a file the daemon then cannot remove, a 0666 temporary
file that receives what the daemon writes, or a symlink to a file of the daemon's user.
So the state lives in a :class:`StateDir` (:func:`resolve`), and every state file is
read and written the same way:

- :func:`private_dir` makes a directory 0700 or checks the one it is given: a real
  directory (no symlink), owned by this user, writable by no one else.
- :func:`read_private` opens with ``O_NOFOLLOW`` and ``O_NONBLOCK`` (a planted FIFO never
  blocks the start) and reads only a regular file of this user, within a size bound.
- :func:`write_private` writes a temporary file of a random name, created with
  ``O_EXCL | O_NOFOLLOW`` and mode 0600, then renames it over the target: a planted
  file or link is never opened, and the data is never readable by another user.
- :func:`remove` unlinks; where it cannot, one log line, never an exception (a start
  or a stop goes on).

The warm index of the memory tier stays beside its pool segment (it must be found
with it) and is written and read with the same two functions.

Primitives: :class:`StateDir`, :func:`resolve`, :func:`private_dir`,
:func:`read_private`, :func:`write_private`, :func:`temp_target`, :func:`remove`,
:class:`UntrustedFile`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

logger = logging.getLogger(__name__)

APP_NAME = "lmcache-server"
TEMP_SUFFIX = ".tmp"
_TEMP_RE = re.compile(r"^(?P<target>.+)\.[0-9a-f]{16}\.tmp$")


class UntrustedFile(OSError):
    """A state file or directory that another user could have written (not this
    user's, a symlink, not a regular file or directory, writable by others, too large)."""


@dataclass(frozen=True)
class StateDir:
    """A private directory holding one daemon's state files.

    ``tag`` is empty where the directory is this daemon's alone (its spill directory,
    locked by the disk tier); elsewhere (``state_dir``, the per-user default) several
    daemons of one user may share it, and each file name carries a tag of the
    daemon's ``listen`` addresses."""

    root: Path
    tag: str = ""

    def file(self, stem: str, suffix: str) -> Path:
        """The path of this daemon's state file ``stem`` (e.g. ``redis-pending``, ``.json``)."""
        return self.root / (f"{stem}-{self.tag}{suffix}" if self.tag else f"{stem}{suffix}")


def listen_tag(listen: Sequence[str]) -> str:
    """16 hex digits naming a daemon by its listen addresses."""
    return hashlib.sha256("\n".join(listen).encode()).hexdigest()[:16]


def default_dir() -> Path:
    """The per-user default: ``$XDG_STATE_HOME/lmcache-server``, else
    ``~/.local/state/lmcache-server``."""
    xdg = os.environ.get("XDG_STATE_HOME", "")
    base = Path(xdg) if xdg.startswith("/") else Path.home() / ".local" / "state"
    return base / APP_NAME


def resolve(configured: str | None, spill_dir: Path | None, listen: Sequence[str]) -> StateDir | None:
    """The state directory of a daemon: ``state_dir`` when configured (an unusable one
    raises :class:`OSError`: the caller refuses the start), else the spill directory,
    else :func:`default_dir`; None (one WARNING line) where the implicit one cannot be
    made private: the daemon then keeps no state across a stop."""
    if configured is not None:
        return StateDir(private_dir(Path(configured)), listen_tag(listen))
    where: Path | str = "the default state directory"
    try:
        where, tag = (spill_dir, "") if spill_dir is not None else (default_dir(), listen_tag(listen))
        return StateDir(private_dir(where), tag)
    except (OSError, RuntimeError) as err:  # RuntimeError: Path.home() without a home
        logger.warning(
            "no private state directory (%s: %s): nothing is kept across a stop (Redis removals owed, "
            "announced chunks) and a warm restart needs the same host name; set state_dir",
            where,
            err,
        )
        return None


def private_dir(path: Path) -> Path:
    """``path``, created 0700 (with its parents) if missing, checked: a directory, not a
    symlink, owned by this user, writable by nobody else (:class:`UntrustedFile`)."""
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UntrustedFile(f"{path} is not a directory (a symlink or a file)") from None
        raise
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    if info.st_uid != os.geteuid():
        raise UntrustedFile(f"{path} is owned by uid {info.st_uid}, not this user (uid {os.geteuid()})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedFile(f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o})")
    return path


def read_private(path: Path, max_bytes: int) -> bytes | None:
    """The bytes of ``path`` (None: there is none); :class:`UntrustedFile` when it is not a
    regular file of this user or is larger than ``max_bytes``; other OSErrors as raised."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            raise UntrustedFile(f"{path} is a symlink") from None
        raise
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise UntrustedFile(f"{path} is not a regular file of this user (uid {info.st_uid})")
        if info.st_size > max_bytes:
            raise UntrustedFile(f"{path} is {info.st_size} bytes, more than {max_bytes}")
        return f.read(max_bytes + 1)[:max_bytes]


@contextlib.contextmanager
def write_private(path: Path) -> Iterator[BinaryIO]:
    """A file to write ``path``'s new content to: a temporary file of a random name
    beside it (``O_EXCL | O_NOFOLLOW``, mode 0600), renamed over ``path`` when the block
    ends; removed, and the error raised, when the block or the rename fails."""
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(8)}{TEMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        remove(tmp, "a temporary state file")
        raise


def temp_target(name: str) -> str | None:
    """The file name a temporary file of :func:`write_private` was meant to become (None:
    ``name`` is not one)."""
    match = _TEMP_RE.match(name)
    return match.group("target") if match else None


def remove(path: Path, what: str) -> bool:
    """Unlink ``path`` (gone already counts); False with one WARNING line where it cannot."""
    try:
        path.unlink(missing_ok=True)
        return True
    except OSError as err:
        logger.warning("cannot remove %s %s (%s); left in place", what, path, err)
        return False
