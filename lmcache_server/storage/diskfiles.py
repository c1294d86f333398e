"""The disk tier's files: where a chunk's record lives, and the blocking I/O on it.

Every function here blocks and runs on the disk tier's thread pool.

Primitives: :func:`path_for`, :func:`write_record` (temp file + rename, optional
fsync), :func:`read_record` (verified payload, optionally into a given buffer),
:func:`unlink`, :func:`scan` (rebuild an index from a directory), :func:`disk_usage`.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

from .base import ChunkKey
from .chunkfile import CorruptRecord, parse_header, verify_payload

logger = logging.getLogger(__name__)

HEADER_BLOCK = 4096
BLOCK = 4096
SUFFIX = ".chunk"
TMP_PREFIX = ".tmp-"


def disk_usage(size: int) -> int:
    """Bytes a file of ``size`` bytes occupies on disk (whole 4 KiB blocks, as du counts)."""
    return (size + BLOCK - 1) // BLOCK * BLOCK


def path_for(root: Path, key: ChunkKey) -> str:
    digest = hashlib.sha256(key.namespace.encode() + b"\0" + key.digest).hexdigest()
    return str(root / "v1" / digest[:2] / (digest + SUFFIX))


# -- blocking helpers (run on the I/O thread pool) -------------------------------------
def write_record(path: str, header: bytes, payload: Any, fsync: str) -> int:
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{time.monotonic_ns()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.write(fd, header)
            view = memoryview(payload).cast("B")
            while view:
                view = view[os.write(fd, view) :]
            if fsync != "none":
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if fsync == "full":
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return len(header) + memoryview(payload).nbytes


def read_record(path: str, key: ChunkKey, out: memoryview | None = None) -> memoryview:
    """The verified payload of the record at ``path``, read into ``out`` when given
    (it must be exactly the payload's size) or into a new buffer."""
    with open(path, "rb", buffering=0) as f:
        head = f.read(HEADER_BLOCK)
        header = parse_header(head)
        if len(head) < header.header_len:
            raise CorruptRecord("record truncated inside its header")
        f.seek(header.header_len)
        payload = memoryview(bytearray(header.payload_len)) if out is None else out
        if payload.nbytes != header.payload_len:
            raise CorruptRecord(f"record holds {header.payload_len} bytes, index says {payload.nbytes}")
        got = f.readinto(payload)
        if got != header.payload_len or f.read(1):
            raise CorruptRecord(f"payload is not {header.payload_len} bytes")
    verify_payload(header, payload, key.namespace, key.digest)
    return payload


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_ScanEntry = tuple[float, ChunkKey, str, int, int]  # mtime, key, path, payload_len, disk_bytes


def scan(root: Path, threads: int = 16) -> tuple[list[_ScanEntry], int]:
    """Index entries found under root (oldest first) and the number of damaged or
    foreign files removed.  The fan-out directories are read in parallel: on a
    cold cache each header is a random read, and the device serves many at once."""
    base = root / "v1"
    if not base.is_dir():
        return [], 0
    subdirs = [d.path for d in os.scandir(base) if d.is_dir(follow_symlinks=False)]
    found: list[_ScanEntry] = []
    removed = 0
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="lmcache-scan") as pool:
        for entries, bad in pool.map(lambda d: _scan_dir(root, d), subdirs):
            found.extend(entries)
            removed += bad
    found.sort(key=lambda e: e[0])  # oldest first: LRU order
    return found, removed


def _scan_dir(root: Path, directory: str) -> tuple[list[_ScanEntry], int]:
    found: list[_ScanEntry] = []
    removed = 0
    for item in os.scandir(directory):
        if item.name.startswith(TMP_PREFIX):
            unlink(item.path)  # a write that never finished
            continue
        if not item.name.endswith(SUFFIX) or not item.is_file(follow_symlinks=False):
            continue
        try:
            st = item.stat(follow_symlinks=False)
            with open(item.path, "rb", buffering=0) as f:
                header = parse_header(f.read(HEADER_BLOCK))
            key = ChunkKey(header.namespace, header.key)
            if st.st_size != header.header_len + header.payload_len:
                raise CorruptRecord("file size does not match its header")
            if path_for(root, key) != item.path:
                raise CorruptRecord("file is not where its key belongs")
        except (CorruptRecord, OSError) as err:
            logger.warning("disk tier: removing %s: %s", item.path, err)
            unlink(item.path)
            removed += 1
            continue
        found.append((st.st_mtime, key, item.path, header.payload_len, disk_usage(st.st_size)))
    return found, removed
