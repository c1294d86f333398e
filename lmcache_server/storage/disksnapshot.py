"""The disk tier's index snapshot: written at a clean shutdown, so that a restart
need not open every chunk file to rebuild the index.

``<root>/v1/index.snapshot`` holds the index (namespace, key, payload length,
bytes on disk per chunk, oldest first) behind a header with a magic, a format
version, the entry count and a CRC32C of the body.  It is trusted only when
all of these hold, checked at the next start:

- the header and the checksum are right (else it is damaged);
- it can be removed before it is used, so a daemon that later crashes leaves
  none behind, and the next start scans (the directory may then differ);
- the directory holds exactly the chunk files it names, no more, no fewer
  (a file written, removed or renamed after it was taken makes it stale).

Otherwise the index is rebuilt by the scan, as without a snapshot.  Either
way every read still verifies the record's header and payload checksum, so a
file damaged in place while the daemon was down is a miss, never wrong bytes.

Blocking; runs on the disk tier's I/O threads.  Primitives: :func:`save`,
:func:`load`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import sys
from pathlib import Path

import msgpack

from .base import ChunkKey
from .chunkfile import checksum
from .diskfiles import HEADER_BLOCK, SUFFIX, TMP_PREFIX, disk_usage, unlink

logger = logging.getLogger(__name__)

NAME = "index.snapshot"
_MAGIC = b"LMIX"
_VERSION = 1
_HEAD = struct.Struct("<4sHHQI")  # magic, version, reserved, entries, body CRC32C

SnapshotEntry = tuple[ChunkKey, int, int]  # key, payload_len, disk_bytes (its file: diskfiles.path_for)


def save(root: Path, entries: list[tuple[ChunkKey, int]]) -> None:
    """Write the snapshot of ``entries`` ((key, payload_len), oldest first), atomically."""
    namespaces: dict[str, int] = {}
    rows = [[namespaces.setdefault(key.namespace, len(namespaces)), key.digest, size] for key, size in entries]
    body = msgpack.packb([list(namespaces), rows], use_bin_type=True)
    base = root / "v1"
    tmp = base / f"{TMP_PREFIX}{NAME}"  # one daemon per directory
    with open(tmp, "wb") as f:
        f.write(_HEAD.pack(_MAGIC, _VERSION, 0, len(rows), checksum(body)))
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, base / NAME)


def load(root: Path) -> list[SnapshotEntry] | None:
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
    decoded = _decode(raw)
    if decoded is None:
        logger.warning("disk tier: index snapshot %s is damaged; scanning", path)
        return None
    entries, names = decoded
    if _chunk_files(root / "v1") != names:
        logger.info("disk tier: index snapshot is stale (the directory changed since); scanning")
        return None
    return entries


def _decode(raw: bytes) -> tuple[list[SnapshotEntry], set[str]] | None:
    """The entries, and the names of their files (``<h[:2]>/<h>.chunk``), or None if damaged.

    Built for a million entries in a few seconds: no Path object per entry,
    one namespace string per namespace, one size object per size."""
    if len(raw) < _HEAD.size:
        return None
    magic, version, _, count, body_crc = _HEAD.unpack_from(raw)
    body = memoryview(raw)[_HEAD.size :]
    if magic != _MAGIC or version != _VERSION or checksum(body) != body_crc:
        return None
    try:
        namespaces, rows = msgpack.unpackb(body, raw=False)
        prefixes = [str(ns).encode() + b"\0" for ns in namespaces]
        spaces = [sys.intern(str(ns)) for ns in namespaces]
        sizes: dict[int, tuple[int, int]] = {}
        entries: list[SnapshotEntry] = []
        names: set[str] = set()
        sha256 = hashlib.sha256
        for ns_index, digest, size in rows:
            digest = bytes(digest)
            sized = sizes.get(size)
            if sized is None:
                size = int(size)
                if size < 0:
                    return None
                sized = sizes[size] = (size, disk_usage(HEADER_BLOCK + size))
            entries.append((ChunkKey(spaces[ns_index], digest), sized[0], sized[1]))
            h = sha256(prefixes[ns_index] + digest).hexdigest()
            names.add(f"{h[:2]}/{h}{SUFFIX}")
    except (ValueError, TypeError, IndexError, KeyError, msgpack.UnpackException):
        return None
    return (entries, names) if len(entries) == count == len(names) else None


def _chunk_files(base: Path) -> set[str]:
    """``<sub>/<name>`` of the chunk files under ``base`` (names only: no file is
    opened); leftover temp files are removed, as the scan would."""
    found: set[str] = set()
    for sub in os.scandir(base):
        if not sub.is_dir(follow_symlinks=False):
            continue
        prefix = sub.name + "/"
        for item in os.scandir(sub.path):
            if item.name.startswith(TMP_PREFIX):
                unlink(item.path)
            elif item.name.endswith(SUFFIX):
                found.add(prefix + item.name)
    return found
