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

import logging
import os
import struct
from pathlib import Path

import msgpack

from .base import ChunkKey
from .chunkfile import checksum
from .diskfiles import HEADER_BLOCK, SUFFIX, TMP_PREFIX, disk_usage, path_for, unlink

logger = logging.getLogger(__name__)

NAME = "index.snapshot"
_MAGIC = b"LMIX"
_VERSION = 1
_HEAD = struct.Struct("<4sHHQI")  # magic, version, reserved, entries, body CRC32C

SnapshotEntry = tuple[ChunkKey, str, int, int]  # key, path, payload_len, disk_bytes


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
    entries = _decode(root, raw)
    if entries is None:
        logger.warning("disk tier: index snapshot %s is damaged; scanning", path)
        return None
    on_disk = _chunk_files(root / "v1")
    if on_disk != {e[1] for e in entries} or len(on_disk) != len(entries):
        logger.info("disk tier: index snapshot is stale (the directory changed since); scanning")
        return None
    return entries


def _decode(root: Path, raw: bytes) -> list[SnapshotEntry] | None:
    if len(raw) < _HEAD.size:
        return None
    magic, version, _, count, body_crc = _HEAD.unpack_from(raw)
    body = memoryview(raw)[_HEAD.size :]
    if magic != _MAGIC or version != _VERSION or checksum(body) != body_crc:
        return None
    try:
        namespaces, rows = msgpack.unpackb(body, raw=False)
        entries = []
        for ns_index, digest, size in rows:
            key = ChunkKey(str(namespaces[ns_index]), bytes(digest))
            entries.append((key, path_for(root, key), int(size), disk_usage(HEADER_BLOCK + int(size))))
    except (ValueError, TypeError, IndexError, KeyError, msgpack.UnpackException):
        return None
    return entries if len(entries) == count else None


def _chunk_files(base: Path) -> set[str]:
    """Paths of the chunk files under ``base`` (names only: no file is opened);
    leftover temp files are removed, as the scan would."""
    found: set[str] = set()
    for sub in os.scandir(base):
        if not sub.is_dir(follow_symlinks=False):
            continue
        for item in os.scandir(sub.path):
            if item.name.startswith(TMP_PREFIX):
                unlink(item.path)
            elif item.name.endswith(SUFFIX):
                found.add(item.path)
    return found
