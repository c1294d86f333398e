"""The disk tier's files: where a chunk's record lives, and the blocking I/O on it.

Every function here blocks and runs on the disk tier's thread pool.

Primitives: :func:`path_for`, :func:`write_record` (temp file + rename, optional
fsync, optional O_DIRECT), :func:`read_record` (verified payload, optionally into
a given buffer), :func:`read_header`, :func:`unlink`, :func:`scan` (rebuild an
index from a directory, with the records' token ids when asked),
:func:`disk_usage`, :func:`direct_io_works`, :func:`aligned_copy`.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import hashlib
import logging
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any

from lmcache_client.keys import ChunkTokens

from ...filelock import LockHeld, hold_lock
from ..base import ChunkKey
from ..chunkfile import CorruptRecord, RecordHeader, encode_header, header_length, parse_header, verify_payload

logger = logging.getLogger(__name__)

HEADER_BLOCK = 4096
BLOCK = 4096
SUFFIX = ".chunk"
TMP_PREFIX = ".tmp-"
LOCK_NAME = "lmcache.lock"
"""An exclusive ``flock`` on this file in the spill directory marks it as one daemon's."""


class DirectoryInUse(Exception):
    """Another daemon holds the spill directory's lock."""


def lock_directory(root: Path) -> int:
    """Take the exclusive lock on ``root`` (created if missing) and return its fd,
    held for the daemon's life (the kernel drops it when the process dies).

    Raises :class:`DirectoryInUse` if another process holds it; ``OSError`` if
    the directory or the lock file cannot be made."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        return hold_lock(root / LOCK_NAME)
    except LockHeld:
        raise DirectoryInUse(str(root)) from None


def disk_usage(size: int) -> int:
    """Bytes a file of ``size`` bytes occupies on disk (whole 4 KiB blocks, as du counts)."""
    return (size + BLOCK - 1) // BLOCK * BLOCK


def path_for(root: Path, key: ChunkKey) -> str:
    digest = hashlib.sha256(key.namespace.encode() + b"\0" + key.digest).hexdigest()
    return str(root / "v1" / digest[:2] / (digest + SUFFIX))


# -- blocking helpers (run on the I/O thread pool) -------------------------------------
_scratch = threading.local()
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # fault the copy's pages in at once


def _scratch_pages() -> mmap.mmap:
    """Two page-aligned pages of this thread: the header, and a partial last block."""
    pages = getattr(_scratch, "pages", None)
    if pages is None:
        pages = _scratch.pages = mmap.mmap(-1, 2 * BLOCK)
    return pages


def _address(view: memoryview) -> int | None:
    """The address of a writable buffer's first byte (None for read-only buffers)."""
    if view.readonly or not view.nbytes:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def direct_io_works(directory: str) -> bool:
    """Whether files in ``directory`` can be written with O_DIRECT (tmpfs and some
    network filesystems refuse it)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = os.path.join(directory, f"{TMP_PREFIX}direct-{os.getpid()}-{time.monotonic_ns()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        return os.pwrite(fd, memoryview(_scratch_pages())[:BLOCK], 0) == BLOCK
    except OSError:
        return False
    finally:
        os.close(fd)
        unlink(probe)


def aligned_copy(data: Any) -> memoryview:
    """A copy of ``data`` in fresh page-aligned memory (so it can be written with O_DIRECT)."""
    src = memoryview(data).cast("B")
    buf = mmap.mmap(-1, max(src.nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_POPULATE)
    view = memoryview(buf)[: src.nbytes]
    view[:] = src
    return view


def write_record(
    path: str, key: ChunkKey, payload: Any, fsync: str, direct: bool = False, tokens: ChunkTokens | None = None
) -> int:
    """Write the record of ``payload`` (with ``tokens`` when given) to ``path``
    atomically (temp file + rename); the payload checksum is computed here, on the
    I/O thread.

    ``direct``: write with O_DIRECT (no page-cache copy, nothing cached twice)
    when the payload lies page-aligned in memory, as pool extents and
    :func:`aligned_copy` buffers do, and the header fits one block (token ids
    of up to about 1,000 tokens do); any other record is written buffered.
    """
    view = memoryview(payload).cast("B")
    header = encode_header(key.namespace, key.digest, view, pad_to=HEADER_BLOCK, tokens=tokens)
    address = _address(view)
    direct = direct and len(header) == HEADER_BLOCK and address is not None and address % BLOCK == 0
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{time.monotonic_ns()}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0)
    fd = os.open(tmp, flags, 0o600)
    try:
        try:
            if direct:
                _write_direct(fd, header, view)
            else:
                _write_all(fd, [memoryview(header), view], 0)
            if fsync != "none":
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        unlink(tmp)
        raise
    if fsync == "full":
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return len(header) + view.nbytes


def _write_direct(fd: int, header: bytes, payload: memoryview) -> None:
    """Header and whole payload blocks in one pwritev straight from their memory;
    a partial last block goes through a zero-padded scratch page and the file
    is then cut to the record's exact length (no stray bytes from the pool)."""
    pages = memoryview(_scratch_pages())
    pages[:BLOCK] = header
    whole = payload.nbytes // BLOCK * BLOCK
    tail = payload.nbytes - whole
    if tail:
        pages[BLOCK : BLOCK + tail] = payload[whole:]
        pages[BLOCK + tail :] = bytes(BLOCK - tail)
    buffers = [pages[:BLOCK], payload[:whole]] + ([pages[BLOCK:]] if tail else [])
    _write_all(fd, buffers, 0)
    if tail:
        os.ftruncate(fd, HEADER_BLOCK + payload.nbytes)


def _write_all(fd: int, buffers: list[memoryview], offset: int) -> None:
    """pwritev until every byte is written (a regular file rarely writes short)."""
    buffers = [b for b in buffers if b.nbytes]
    while buffers:
        done = os.pwritev(fd, buffers, offset)
        offset += done
        while buffers and done >= buffers[0].nbytes:
            done -= buffers[0].nbytes
            buffers.pop(0)
        if done:
            buffers[0] = buffers[0][done:]


def read_record(path: str, key: ChunkKey, out: memoryview | None = None, uncache: bool = False) -> memoryview:
    """The verified payload of the record at ``path``, read into ``out`` when given
    (it must be exactly the payload's size) or into a new buffer.

    Reads go through the page cache (its readahead keeps several requests in
    flight, which beats one O_DIRECT request per chunk on the devices measured);
    ``uncache`` then drops the file's pages, so the chunk is not held twice.
    """
    with open(path, "rb", buffering=0) as f:
        header = read_header(f)
        f.seek(header.header_len)
        payload = memoryview(bytearray(header.payload_len)) if out is None else out
        if payload.nbytes != header.payload_len:
            raise CorruptRecord(f"record holds {header.payload_len} bytes, index says {payload.nbytes}")
        got = f.readinto(payload)
        if got != header.payload_len or f.read(1):
            raise CorruptRecord(f"payload is not {header.payload_len} bytes")
        if uncache:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    verify_payload(header, payload, key.namespace, key.digest)
    return payload


def read_header(f: Any) -> RecordHeader:
    """The checked header of the record open as ``f`` (read from its start: one block,
    more when its token ids do not fit one)."""
    head = f.read(HEADER_BLOCK)
    need = header_length(head)
    if need > len(head):
        head += f.read(need - len(head))
        if len(head) < need:
            raise CorruptRecord("record truncated inside its header")
    return parse_header(head)


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_ScanEntry = tuple[float, ChunkKey, str, int, int, ChunkTokens | None]
"""mtime, key, path, payload_len, disk_bytes, token ids (when the record has them and they were asked for)."""


SCAN_PROGRESS_S = 5.0
"""How often a scan logs its progress: a million records take minutes on a cold disk, and a
start that is slow must be visible (to an operator, and beside a startup probe's limit)."""


def scan(
    root: Path, threads: int = 16, tokens: bool = False, progress_s: float = SCAN_PROGRESS_S
) -> tuple[list[_ScanEntry], int]:
    """Index entries found under root (oldest first) and the number of damaged or
    foreign files removed; with ``tokens``, each entry's token ids from its header
    (None when it has none).  The fan-out directories are read in parallel: on a
    cold cache each header is a random read, and the device serves many at once.
    Every ``progress_s`` seconds one INFO line says how far the scan is."""
    base = root / "v1"
    if not base.is_dir():
        return [], 0
    subdirs = [d.path for d in os.scandir(base) if d.is_dir(follow_symlinks=False)]
    found: list[_ScanEntry] = []
    removed = 0
    started = last = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="lmcache-scan") as pool:
        for done, (entries, bad) in enumerate(pool.map(lambda d: _scan_dir(root, d, tokens), subdirs), 1):
            found.extend(entries)
            removed += bad
            now = time.monotonic()
            if now - last >= progress_s and done < len(subdirs):
                last = now
                logger.info(
                    "disk tier: rebuilding the index from %s: %d of %d directories, %d records so far (%.0f s)",
                    root,
                    done,
                    len(subdirs),
                    len(found),
                    now - started,
                )
    found.sort(key=lambda e: e[0])  # oldest first: LRU order
    return found, removed


def _scan_dir(root: Path, directory: str, tokens: bool) -> tuple[list[_ScanEntry], int]:
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
                header = read_header(f)
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
        found.append(
            (st.st_mtime, key, item.path, header.payload_len, disk_usage(st.st_size), header.tokens if tokens else None)
        )
    return found, removed
