"""The disk tier's index snapshot: written at a clean shutdown, so that a restart
need not open every chunk file to rebuild the index.

``<root>/v1/index.snapshot`` holds the index (namespace, key, payload length
per chunk, oldest first) behind a header with a magic, a format version, the
entry count and a CRC32C of the body.  It is trusted only when all of these
hold, checked at the next start:

- the header and the checksum are right (else it is damaged);
- it can be removed before it is used, so a daemon that later crashes leaves
  none behind, and the next start scans (the directory may then differ);
- the directory holds exactly the chunk files it names, no more, no fewer
  (a file written, removed or renamed after it was taken makes it stale).
  Format 2 checks this without listing a million names (on a cold cache that
  listing alone took longer than the 10 s a restart may take): it records
  the fan-out directories with their modification times, and as its own
  time the filesystem's clock (the mtime of a probe file created just
  before the directories are read: the same clock and granularity as
  theirs).  A directory whose time is unchanged and older than that has not
  changed since (any change to its entries sets a time at least the
  probe's); one whose time is not older (*racy*, as git calls its index
  entries of that kind) is listed and compared name by name; any other
  difference makes the snapshot stale.  The save waits up to ``SAVE_WAIT_S``
  for the clock to pass the directories' times, so that after a drained
  spill queue none is racy.

Otherwise the index is rebuilt by the scan, as without a snapshot.  Either
way every read still verifies the record's header and payload checksum, so a
file damaged in place while the daemon was down is a miss, never wrong bytes.

Format 2 (written now) is columnar, so that a million entries load without a
Python object per field: the namespaces, the distinct payload sizes and the
directories (name, mtime in ns; and the snapshot's own time) as short tables
(msgpack), then per entry a 4-byte namespace index, a 4-byte size index and
the 32-byte digest, each column one little-endian array.
Format 1 (msgpack rows; written before) still loads; a snapshot of any
other version is ignored (the scan rebuilds the index).

Blocking; runs on the disk tier's I/O threads.  Primitives: :func:`save`,
:func:`load` (a :class:`Snapshot`).
"""

from __future__ import annotations

import array
import concurrent.futures
import dataclasses
import hashlib
import logging
import operator
import os
import struct
import sys
import time
from collections.abc import Sequence
from itertools import repeat
from pathlib import Path

import msgpack

from ..base import ChunkKey
from ..chunkfile import checksum
from .files import HEADER_BLOCK, SUFFIX, TMP_PREFIX, disk_usage, unlink

logger = logging.getLogger(__name__)

NAME = "index.snapshot"
_MAGIC = b"LMIX"
_VERSION = 2
_HEAD = struct.Struct("<4sHHQI")  # magic, version, reserved, entries, body CRC32C
_TABLES = struct.Struct("<QQQ")  # bytes of the namespace, size and directory tables (format 2)
SAVE_WAIT_S = 3.0
"""How long a save waits for the filesystem's clock to pass every directory's mtime."""
_DIGEST = 32
_LISTING_THREADS = 16


@dataclasses.dataclass(slots=True)
class Snapshot:
    """The index a snapshot holds, oldest first, as columns: ``keys[i]`` has the
    sizes ``sizes[size_index[i]]`` (payload length, bytes on disk)."""

    keys: list[ChunkKey]
    size_index: array.array[int]
    sizes: list[tuple[int, int]]

    def __len__(self) -> int:
        return len(self.keys)


def _le(typecode: str, data: bytes | memoryview) -> array.array[int]:
    column = array.array(typecode)
    column.frombytes(data)
    if sys.byteorder == "big":
        column.byteswap()
    return column


def save(root: Path, entries: list[tuple[ChunkKey, int]]) -> None:
    """Write the snapshot of ``entries`` ((key, payload_len), oldest first), atomically."""
    if any(len(key.digest) != _DIGEST for key, _ in entries):
        body, version = _body_v1(entries), 1  # keys of another length: the row format holds them
    else:
        body, version = _body_v2(entries, _directories(root / "v1")), _VERSION
    _write(root, body, version, len(entries))


def _write(root: Path, body: bytes, version: int, count: int) -> None:
    base = root / "v1"
    tmp = base / f"{TMP_PREFIX}{NAME}"  # one daemon per directory
    with open(tmp, "wb") as f:
        f.write(_HEAD.pack(_MAGIC, version, 0, count, checksum(body)))
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, base / NAME)


def _body_v1(entries: list[tuple[ChunkKey, int]]) -> bytes:
    namespaces: dict[str, int] = {}
    rows = [[namespaces.setdefault(key.namespace, len(namespaces)), key.digest, size] for key, size in entries]
    return bytes(msgpack.packb([list(namespaces), rows], use_bin_type=True))


def _directories(base: Path) -> list[object]:
    """``[taken_ns, [[name, mtime_ns], ...]]``: the fan-out directories' times,
    read after ``taken_ns``, the filesystem's clock (see the module docstring);
    read again a little later while one is not older than it."""
    deadline = time.monotonic() + SAVE_WAIT_S
    while True:
        taken = _fs_clock(base)
        dirs: list[tuple[str, int]] = [
            (d.name, d.stat(follow_symlinks=False).st_mtime_ns)
            for d in os.scandir(base)
            if d.is_dir(follow_symlinks=False)
        ]
        if all(mtime < taken for _, mtime in dirs) or time.monotonic() >= deadline:
            return [taken, [[name, mtime] for name, mtime in sorted(dirs)]]
        time.sleep(0.02)  # a directory changed in the clock's current tick (or later)


def _fs_clock(base: Path) -> int:
    """The filesystem's time now: the mtime of a probe file made in ``base``."""
    probe = base / f"{TMP_PREFIX}clock-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        return probe.stat().st_mtime_ns
    finally:
        unlink(str(probe))


def _body_v2(entries: list[tuple[ChunkKey, int]], dirs: list[object]) -> bytes:
    namespaces: dict[str, int] = {}
    sizes: dict[int, int] = {}
    ns_index = array.array("I", [namespaces.setdefault(key.namespace, len(namespaces)) for key, _ in entries])
    size_index = array.array("I", [sizes.setdefault(size, len(sizes)) for _, size in entries])
    if sys.byteorder == "big":
        ns_index.byteswap()
        size_index.byteswap()
    ns_table = msgpack.packb(list(namespaces), use_bin_type=True)
    size_table = msgpack.packb(list(sizes), use_bin_type=True)
    dir_table = msgpack.packb(dirs, use_bin_type=True)
    digests = b"".join(key.digest for key, _ in entries)
    return b"".join(
        [
            _TABLES.pack(len(ns_table), len(size_table), len(dir_table)),
            ns_table,
            size_table,
            dir_table,
            ns_index.tobytes(),
            size_index.tobytes(),
            digests,
        ]
    )


def load(root: Path) -> Snapshot | None:
    """The index from the snapshot, oldest first, or None when there is none or
    it cannot be trusted (see the module docstring); removes it either way."""
    path = root / "v1" / NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        logger.warning("disk tier: cannot read index snapshot %s (%s); scanning", path, err)
        return None
    try:
        os.unlink(path)  # used once: a crash from now on must not find it
    except OSError as err:
        logger.warning("disk tier: cannot remove index snapshot %s (%s); scanning", path, err)
        return None
    version = _HEAD.unpack_from(raw)[1] if len(raw) >= _HEAD.size and raw[:4] == _MAGIC else None
    if version is not None and version not in (1, _VERSION):
        logger.warning("disk tier: index snapshot %s has format %d, not one this daemon reads; scanning", path, version)
        return None
    decoded = _decode(raw)
    if decoded is None:
        logger.warning("disk tier: index snapshot %s is damaged; scanning", path)
        return None
    if not decoded.matches(root / "v1"):
        logger.info("disk tier: index snapshot is stale (the directory changed since); scanning")
        return None
    return decoded.snapshot


@dataclasses.dataclass(slots=True)
class _Decoded:
    snapshot: Snapshot
    prefixes: list[bytes]  # per namespace: what a file name hashes before the digest
    ns_index: Sequence[int]
    digests: list[bytes]
    dirs: tuple[int, dict[str, int]] | None  # (taken_ns, name -> mtime_ns); None: format 1

    def names(self, subs: set[str] | None = None) -> set[str]:
        """``<h[:2]>/<h>.chunk`` of its files (only those in ``subs`` when given)."""
        # No Python loop per entry: each step is a C-level map over the columns.
        hashed = map(hashlib.sha256, map(bytes.__add__, map(self.prefixes.__getitem__, self.ns_index), self.digests))
        names = map(("{0:.2}/{0}" + SUFFIX).format, map(operator.methodcaller("hexdigest"), hashed))
        if subs is None:
            return set(names)
        return {name for name in names if name[:2] in subs}

    def matches(self, base: Path) -> bool:
        """Whether ``base`` holds exactly the files it names (see the module docstring)."""
        if self.dirs is None:
            return _chunk_files(base) == self.names()
        taken, recorded = self.dirs
        now = {d.name: d for d in os.scandir(base) if d.is_dir(follow_symlinks=False)}
        if set(now) != set(recorded):
            return False
        racy: set[str] = set()
        for name, entry in now.items():
            mtime = entry.stat(follow_symlinks=False).st_mtime_ns
            if mtime != recorded[name]:
                return False
            if mtime >= taken:
                racy.add(name)
        return not racy or _chunk_files(base, racy) == self.names(racy)


def _decode(raw: bytes) -> _Decoded | None:
    """The snapshot and what its check needs, or None if damaged."""
    if len(raw) < _HEAD.size:
        return None
    magic, version, _, count, body_crc = _HEAD.unpack_from(raw)
    body = memoryview(raw)[_HEAD.size :]
    if magic != _MAGIC or checksum(body) != body_crc:
        return None
    try:
        if version == 1:
            decoded = _decode_v1(body)
        elif version == _VERSION:
            decoded = _decode_v2(body, count)
        else:
            return None
    except (ValueError, TypeError, IndexError, KeyError, OverflowError, struct.error, msgpack.UnpackException):
        return None
    if decoded is None:
        return None
    namespaces, ns_index, digests, sizes, size_index, dirs = decoded
    if len(ns_index) != count or len(digests) != count or len(size_index) != count:
        return None
    if count and (max(ns_index) >= len(namespaces) or max(size_index) >= len(sizes)):
        return None
    if any(not isinstance(s, int) or s < 0 for s in sizes) or any(not isinstance(n, str) for n in namespaces):
        return None
    spaces = [sys.intern(ns) for ns in namespaces]
    keys = list(map(tuple.__new__, repeat(ChunkKey), zip(map(spaces.__getitem__, ns_index), digests)))
    table = [(s, disk_usage(HEADER_BLOCK + s)) for s in sizes]
    snapshot = Snapshot(keys, array.array("I", size_index), table)
    return _Decoded(snapshot, [ns.encode() + b"\0" for ns in namespaces], ns_index, digests, dirs)


_Columns = tuple[list[str], Sequence[int], list[bytes], list[int], Sequence[int], "tuple[int, dict[str, int]] | None"]


def _decode_v1(body: memoryview) -> _Columns | None:
    namespaces, rows = msgpack.unpackb(body, raw=False)
    sizes: dict[int, int] = {}
    ns_index: list[int] = []
    digests: list[bytes] = []
    size_index: list[int] = []
    for ns, digest, size in rows:
        if not isinstance(ns, int) or not isinstance(digest, bytes) or not isinstance(size, int):
            return None
        ns_index.append(ns)
        digests.append(digest)
        size_index.append(sizes.setdefault(size, len(sizes)))
    if ns_index and min(ns_index) < 0:
        return None
    return list(namespaces), ns_index, digests, list(sizes), size_index, None


def _decode_v2(body: memoryview, count: int) -> _Columns | None:
    ns_len, size_len, dir_len = _TABLES.unpack_from(body)
    at = _TABLES.size
    namespaces = msgpack.unpackb(body[at : at + ns_len], raw=False)
    at += ns_len
    sizes = msgpack.unpackb(body[at : at + size_len], raw=False)
    at += size_len
    taken, dir_rows = msgpack.unpackb(body[at : at + dir_len], raw=False)
    at += dir_len
    if not isinstance(namespaces, list) or not isinstance(sizes, list) or not isinstance(taken, int):
        return None
    dirs = {str(name): int(mtime) for name, mtime in dir_rows}
    if len(body) != at + count * (8 + _DIGEST):
        return None
    ns_index = _le("I", body[at : at + 4 * count])
    size_index = _le("I", body[at + 4 * count : at + 8 * count])
    blob = bytes(body[at + 8 * count :])
    digests = [blob[i : i + _DIGEST] for i in range(0, len(blob), _DIGEST)]
    return namespaces, ns_index, digests, sizes, size_index, (taken, dirs)


def _chunk_files(base: Path, subs: set[str] | None = None) -> set[str]:
    """``<sub>/<name>`` of the chunk files under ``base`` (only in the fan-out
    directories ``subs`` when given; names only: no file is opened; listed in
    parallel, as on a cold cache each is a few random reads); leftover temp
    files are removed, as the scan would."""
    if subs is None:
        subs = {sub.name for sub in os.scandir(base) if sub.is_dir(follow_symlinks=False)}
    listed = sorted(subs)
    found: set[str] = set()
    with concurrent.futures.ThreadPoolExecutor(_LISTING_THREADS, thread_name_prefix="lmcache-list") as pool:
        for sub, names in zip(listed, pool.map(lambda s: os.listdir(base / s), listed)):
            chunks = [name for name in names if name.endswith(SUFFIX) and not name.startswith(TMP_PREFIX)]
            if len(chunks) != len(names):
                for name in names:
                    if name.startswith(TMP_PREFIX):
                        unlink(str(base / sub / name))
            found.update(map((sub + "/").__add__, chunks))
    return found
