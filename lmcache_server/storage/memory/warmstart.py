"""Warm restarts: the memory tier survives a clean stop of the daemon.

With ``warm_restart`` on (``lmcache-server --keep-warm``: a supervisor will start
the daemon again), at a clean stop (SIGTERM/SIGINT, after the drain and once
every fill is in) the daemon writes ``<segment>.warm`` beside its pool segment
in ``shm_dir`` and leaves the segment in place (:meth:`WarmStart.save`).  Off
(the default), the segment goes at the stop: a kept one holds host memory the
size of the pool until some later start, so it is kept only where a restart is
expected.  Kept segments nobody will adopt are removed by
:meth:`WarmStart.remove_kept`: at the start of this daemon with ``warm_restart``
off (its own), and by ``lmcache-server cleanup`` (cleanup.py).  The next daemon
(:meth:`WarmStart.find`) adopts it when the index is intact and was written
for the same daemon: the same ``listen`` addresses and the same installation
(its identity, a random id kept in the daemon's private state directory, not
its host name: two installations sharing a directory never take each other's
pool, and a replaced pod or container keeps its pool; :func:`installation_id`),
the same pool size and the same boot, and it is
still the same index once the segment's lock is held.  Anything else is a
cold start with one log line saying why, and the old segment and its index
are removed.  Files of other users in the (sticky) directory are skipped: any
local user can create one there, and none stops a daemon from starting.

The index file is the clean marker.  It is written last, while the segment's
lock is held (a 0600 temporary file of a random name created with ``O_EXCL``,
then a rename; read with ``O_NOFOLLOW`` and an owner check), and removed by
the next daemon the moment it has locked the segment, before it serves anything; a daemon killed later
leaves a segment without index, which the next start removes as stale (see
pool.py).  So a crash (SIGKILL, OOM kill, power loss) is always a cold start of
the memory tier: no bytes are adopted without the proof of a clean stop, and a
put pays nothing for it (no checksum; docs/operations.md).

Four modules, one job each: this one finds, locks and removes segments and
their index files in ``shm_dir`` and writes the index at the stop
(:class:`WarmStart`); :mod:`.warmindex` is the index file (what it holds, its
bytes, its checks); :mod:`.warmadopt` fills the new tier from it
(:class:`Adoption`); :mod:`.installation` says who wrote it (this installation,
this boot).  Their names stay importable from here.

Primitives: :class:`WarmStart` (``find``, ``save``, ``remove_kept``),
:class:`KeptSegment`; from :mod:`.installation`: :func:`installation_id`,
:func:`boot_id`; from :mod:`.warmadopt`: :class:`Adoption` (``restore``); from
:mod:`.warmindex`: :class:`HeldLease`, :class:`HeldSlot`, :func:`encode`,
:func:`decode`, :class:`WarmIndexError`.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..statefiles import temp_target, write_private
from .installation import boot_id, installation_id
from .pool import INDEX_SUFFIX, SEGMENT_RE, MemoryPool, Segment
from .warmadopt import Adoption, WarmMemory
from .warmindex import (
    FORMAT_VERSION,
    MAGIC,
    HeldLease,
    HeldSlot,
    WarmIndex,
    WarmIndexError,
    check,
    decode,
    encode,
)

__all__ = [
    "DEFAULT_MAX_AGE_S",
    "FORMAT_VERSION",
    "LOCK_WAIT_S",
    "MAGIC",
    "MAX_INDEX_BYTES",
    "TMP_SUFFIX",
    "Adoption",
    "HeldLease",
    "HeldSlot",
    "KeptSegment",
    "WarmIndex",
    "WarmIndexError",
    "WarmMemory",
    "WarmStart",
    "boot_id",
    "check",
    "decode",
    "encode",
    "installation_id",
]

logger = logging.getLogger(__name__)

MAX_INDEX_BYTES = 1 << 30
LOCK_WAIT_S = 5.0
"""How long a new daemon waits for the old one to let go of the segment (it exits right after the index)."""
TMP_SUFFIX = ".tmp"


DEFAULT_MAX_AGE_S = 3600.0


@dataclass(frozen=True)
class KeptSegment:
    """A pool segment a clean stop kept for a warm restart, as
    :meth:`WarmStart.remove_kept` found it."""

    name: str
    held_bytes: int
    """Host memory it held (its tmpfs pages)."""
    identity: tuple[str, ...]
    """The ``listen`` addresses of the daemon that kept it."""
    removed: bool
    """False: left alone (``reason`` says why: a running daemon holds it, or it could not be removed)."""
    reason: str = ""


class WarmStart:
    """Finds and adopts, or writes, the warm-restart index of one daemon."""

    def __init__(
        self,
        shm_dir: str | os.PathLike[str],
        identity: Sequence[str],
        pool_size: int,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        installation: str | None = None,
    ):
        self.shm_dir = Path(shm_dir)
        self.identity = tuple(sorted(identity))
        self.pool_size = pool_size
        self.max_age_s = max_age_s
        self.installation = installation if installation is not None else installation_id()
        """A clean segment another daemon left longer ago than this is an orphan (its
        daemon moved or retired): removed, so it does not hold the host's memory forever."""

    def find(self) -> Adoption | None:
        """The segment left by this daemon's last clean stop, locked and with its
        index removed (the marker is gone: a crash from now on is a cold start);
        None for a cold start (one log line says why).  Never raises OSError: files
        of other users in a shared (sticky) directory are skipped, and any other
        failure to read or remove is a cold start."""
        try:
            return self._find()
        except OSError as err:
            logger.warning("warm restart refused, the memory tier starts cold: %s", err)
            return None

    def _find(self) -> Adoption | None:
        try:
            names = sorted(os.listdir(self.shm_dir))
        except OSError:
            return None
        uid = os.geteuid()
        found: list[tuple[float, str, WarmIndex]] = []
        for name in names:
            temp = name.endswith(TMP_SUFFIX)  # <segment>.warm.<random>.tmp (an older daemon's: <segment>.warm.tmp)
            index_name = (temp_target(name) or name.removesuffix(TMP_SUFFIX)) if temp else name
            segment = index_name.removesuffix(INDEX_SUFFIX)
            if segment == index_name or SEGMENT_RE.match(segment) is None:
                continue
            try:
                owner = os.lstat(self.shm_dir / name).st_uid
            except OSError:
                continue
            if owner != uid:  # another user's: neither readable as ours nor ours to remove
                logger.warning("warm restart: skipped %s, not owned by this user (uid %d, not %d)", name, owner, uid)
                continue
            if temp:
                if not _locked(self.shm_dir / segment):  # a stop killed mid-write
                    (self.shm_dir / name).unlink(missing_ok=True)
                continue
            try:
                index = _read(self.shm_dir / name)
            except WarmIndexError as err:
                self._refuse(segment, str(err))
                continue
            if index.identity != self.identity:
                self._foreign(segment, index)
                continue
            if index.installation != self.installation:
                self._refuse(
                    segment,
                    "its index was written by another installation of the daemon (another user, Python "
                    "environment or state directory: the installation id is kept in state_dir)",
                )
                continue
            found.append((index.written_at, segment, index))
        if not found:
            return None
        found.sort(reverse=True)
        for _, segment, _ in found[1:]:
            self._refuse(segment, "a newer clean segment of this daemon exists")
        _, segment, index = found[0]
        try:
            return self._adopt(segment, index)
        except WarmIndexError as err:
            self._refuse(segment, str(err))
            return None

    def _adopt(self, name: str, index: WarmIndex) -> Adoption:
        if index.segment != name:
            raise WarmIndexError(f"the index names segment {index.segment}")
        if index.pool_size != self.pool_size:
            raise WarmIndexError(
                f"pool size changed ({index.pool_size >> 20} MiB in the index, {self.pool_size >> 20} MiB configured)"
            )
        if index.boot_id != boot_id():
            raise WarmIndexError("the host rebooted since the index was written")
        check(index, self.pool_size)
        path = self.shm_dir / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as err:
            raise WarmIndexError(f"cannot open its segment ({err})") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                raise WarmIndexError("its segment is not a regular file of this user")
            if info.st_size != self.pool_size:
                raise WarmIndexError(f"its segment is {info.st_size} bytes, not {self.pool_size}")
            _lock(fd, LOCK_WAIT_S)
            # The index was read before the wait: the old daemon may have written another one since.
            if _read(self.shm_dir / (name + INDEX_SUFFIX)) != index:
                raise WarmIndexError("the index changed while waiting for the segment's lock")
            # The marker goes before anything is served: a crash from here on is a cold start.
            (self.shm_dir / (name + INDEX_SUFFIX)).unlink()
        except BaseException:
            os.close(fd)
            raise
        chunks = len(index.chunks)
        logger.info(
            "warm restart: adopted %s with %d chunks (%d MiB) and %d lease(s) left by the clean stop %.1fs ago",
            name,
            chunks,
            sum(n for _, _, n, _ in index.chunks) >> 20,
            len(index.leases),
            max(0.0, time.time() - index.written_at),
        )
        return Adoption(Segment(path, fd, SEGMENT_RE.match(name).group(2)), index)  # type: ignore[union-attr]

    def _foreign(self, name: str, index: WarmIndex) -> None:
        """A clean segment of a daemon with other ``listen`` addresses: kept for it while
        young, removed once older than ``max_age_s``."""
        age = max(0.0, time.time() - index.written_at)
        owner = ", ".join(index.identity)
        if age > self.max_age_s:
            self._refuse(name, f"left by the daemon listening on {owner} {age:.0f}s ago (warm_restart_max_age_s)")
            return
        try:
            held = os.stat(self.shm_dir / name).st_blocks * 512
        except OSError:
            held = 0
        logger.warning(
            "kept %s (%d MiB of host memory): left by a clean stop of the daemon listening on %s %.0fs ago; "
            "removed when that daemon starts, or by the first start after warm_restart_max_age_s (%.0fs)",
            name,
            held >> 20,
            owner,
            age,
            self.max_age_s,
        )

    def _refuse(self, name: str, reason: str) -> None:
        """Cold start: one log line, and the segment and its index removed (the
        segment only when no daemon holds it)."""
        path = self.shm_dir / name
        (self.shm_dir / (name + INDEX_SUFFIX)).unlink(missing_ok=True)
        if not path.exists():
            fate = f"its pool segment {name} is gone"
        elif _locked(path, remove=True):
            fate = f"the old pool segment {name} is in use by a running daemon, left alone"
        else:
            fate = f"removed the old pool segment {name}"
        logger.warning("warm restart refused, the memory tier starts cold: %s; %s", reason, fate)

    def remove_kept(self, every_daemon: bool = False) -> list[KeptSegment]:
        """Remove the segments that clean stops of this daemon (its ``listen``
        addresses and installation) kept for a warm restart, with their index; with
        ``every_daemon``, those of every daemon of this user in ``shm_dir``, whatever
        its addresses or installation (a pod or container long gone).  A segment
        whose lock a daemon holds (one stopping, its index just written, or one
        adopting it) is left alone; so are other users' files and an index that
        cannot be read.  Never raises OSError: what cannot be removed is reported."""
        try:
            names = sorted(os.listdir(self.shm_dir))
        except OSError:
            return []
        found: list[KeptSegment] = []
        for name in names:
            segment = name.removesuffix(INDEX_SUFFIX)
            if segment == name or SEGMENT_RE.match(segment) is None:
                continue
            try:
                index = _read(self.shm_dir / name)  # another user's is refused here (owner check)
            except WarmIndexError:
                continue
            if not every_daemon and (index.installation != self.installation or index.identity != self.identity):
                continue
            found.append(self._remove_kept(segment, index.identity))
        return found

    def _remove_kept(self, name: str, identity: tuple[str, ...]) -> KeptSegment:
        """Remove one kept segment and its index, both under the segment's lock (so
        neither goes while a daemon still writes or adopts it)."""
        path = self.shm_dir / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:  # an index without its segment: the index alone is junk
            (self.shm_dir / (name + INDEX_SUFFIX)).unlink(missing_ok=True)
            return KeptSegment(name, 0, identity, True)
        except OSError as err:
            return KeptSegment(name, 0, identity, False, f"cannot open it ({err.strerror})")
        try:
            held = os.fstat(fd).st_blocks * 512
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return KeptSegment(name, held, identity, False, "in use by a running daemon")
            (self.shm_dir / (name + INDEX_SUFFIX)).unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            return KeptSegment(name, held, identity, True)
        except OSError as err:
            return KeptSegment(name, 0, identity, False, f"cannot remove it ({err.strerror})")
        finally:
            os.close(fd)

    def save(self, pool: MemoryPool, memory: WarmMemory, leases: list[HeldLease]) -> bool:
        """Write the index of ``memory`` beside its segment (call it once nothing
        writes into the pool any more, before the pool is closed); False
        (logged) where it could not be written: the segment is then removed."""
        if pool.shm_path is None:
            return False
        path = pool.shm_path.with_name(pool.shm_path.name + INDEX_SUFFIX)
        chunks = memory.snapshot()
        index = WarmIndex(
            pool.shm_path.name, pool.size, self.identity, boot_id(), time.time(), chunks, leases, self.installation
        )
        try:
            # A temporary file of a random name, O_EXCL and 0600, then renamed: one another user
            # planted in the (sticky, world-writable) directory is never opened (statefiles).
            with write_private(path) as f:
                f.write(encode(index))
        except OSError as err:
            logger.warning("cannot write the warm-restart index %s (%s): the next start is cold", path, err)
            return False
        logger.info(
            "kept the memory pool for a warm restart: %d chunks (%d MiB), %d lease(s); index %s",
            len(chunks),
            sum(n for _, _, n, _ in chunks) >> 20,
            len(leases),
            path,
        )
        return True


def _read(path: Path) -> WarmIndex:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO never blocks
    except OSError as err:
        raise WarmIndexError(f"cannot open the index ({err})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise WarmIndexError("the index is not a regular file of this user")
        if info.st_size > MAX_INDEX_BYTES:
            raise WarmIndexError(f"the index is {info.st_size} bytes, more than {MAX_INDEX_BYTES}")
        return decode(f.read())


def _lock(fd: int, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise WarmIndexError(f"its segment is still locked by a running daemon after {wait_s:.0f}s") from None
            time.sleep(0.02)


def _locked(path: Path, remove: bool = False) -> bool:
    """Whether a live daemon holds ``path``'s lock; with ``remove``, unlink it if none does."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        if remove:
            path.unlink(missing_ok=True)
        return False
    finally:
        os.close(fd)
