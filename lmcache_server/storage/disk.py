"""The disk tier: a bounded spill directory that survives restarts.

- One file per chunk, ``<root>/v1/<h[:2]>/<h>.chunk`` with ``h`` a SHA-256 of
  (namespace, key), holding a :mod:`.chunkfile` record whose header is padded
  to 4096 bytes.  Files are written to a temp name and renamed into place, so a
  crash leaves either the whole record or none; ``disk_fsync`` chooses whether
  the data (``data``) or the data and the directory entry (``full``) are also
  forced to the device before the chunk is indexed (``none``: the page cache
  decides; a record torn by power loss fails its checksum and is a miss).
- Writes come from a bounded write-behind queue (``enqueue``): memory-tier
  evictions land here and never block the request path; a full queue drops the
  spill and counts it.
- Reads verify the header, the namespace, the key and the payload checksum; a
  damaged, truncated or foreign file is a miss, is deleted and is counted.
- On open the index is rebuilt from the directory (headers only), so the cache
  survives restarts.  Bounded by ``max_bytes`` (bytes on disk, 4 KiB blocks, as
  ``du`` counts them); which chunk leaves is its own eviction policy's choice
  (:mod:`.policy`, the same interface as the memory tier's; LRU unless given
  one), told about inserts, hits and removals.  Rebuilt entries are inserted
  oldest first, so an LRU policy starts in file-age order.
- An unwritable directory or a full disk degrades the tier (log once, metric);
  writes are retried every ``retry_s`` and the daemon keeps serving.

All file I/O runs on a small bounded thread pool (one hop per chunk:
open+write+fsync+rename, or open+read+verify), which aiofiles' one hop per
call would multiply.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import errno
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmcache_client.protocol import PutStatus

from .base import Chunk, ChunkKey
from .chunkfile import CorruptRecord, encode_header
from .diskfiles import HEADER_BLOCK, TMP_PREFIX, disk_usage, path_for, read_record, scan, unlink, write_record
from .policy import EvictionPolicy, LRUPolicy

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class _Entry:
    path: str
    payload_len: int
    disk_bytes: int


@dataclasses.dataclass
class DiskCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    stores: int = 0
    spills: int = 0
    spills_dropped: int = 0
    write_errors: int = 0
    corrupt: int = 0
    rebuilt_entries: int = 0
    rebuild_seconds: float = 0.0


def _never(key: ChunkKey) -> bool:
    return False  # nothing on disk is leased: reads copy the record out


class DiskTier:
    name = "disk"

    def __init__(
        self,
        root: Path,
        max_bytes: int,
        *,
        fsync: str = "none",
        io_threads: int = 2,
        max_queue_bytes: int = 256 << 20,
        retry_s: float = 30.0,
        policy: EvictionPolicy | None = None,
    ):
        self.root = root
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.max_queue_bytes = max_queue_bytes
        self.retry_s = retry_s
        self.counters = DiskCounters()
        self.policy = policy if policy is not None else LRUPolicy()
        self.degraded: str | None = None
        self._degraded_at = 0.0
        self._index: dict[ChunkKey, _Entry] = {}
        self._by_namespace: dict[str, list[int]] = {}
        self.stored_bytes = 0  # payload bytes
        self.disk_bytes = 0  # as du counts them
        self._pool = concurrent.futures.ThreadPoolExecutor(io_threads, thread_name_prefix="lmcache-disk")
        self._io = asyncio.Semaphore(io_threads * 2)
        self._queue: asyncio.Queue[tuple[ChunkKey, bytes]] = asyncio.Queue()
        self._queued_bytes = 0
        self._queued: set[ChunkKey] = set()
        self._writers: list[asyncio.Task[None]] = []
        self._io_threads = io_threads

    async def _run(self, fn: Any, *args: Any) -> Any:
        async with self._io:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # -- lifecycle -----------------------------------------------------------------
    async def open(self) -> None:
        """Check the directory, rebuild the index from it, start the writers."""
        started = time.perf_counter()
        try:
            await self._run(self._prepare_root)
        except OSError as err:
            self._degrade(f"directory {self.root} is not usable ({err})")
        else:
            found, removed = await self._run(scan, self.root)
            self.counters.corrupt += removed
            for _, key, path, payload_len, disk_bytes in found:
                self._add(key, _Entry(path, payload_len, disk_bytes))
            self.counters.rebuilt_entries = len(found)
            await self._shrink_to(self.max_bytes)
        self.counters.rebuild_seconds = round(time.perf_counter() - started, 3)
        logger.info(
            "disk tier at %s: %d chunks, %.1f MiB of %.1f MiB, index rebuilt in %.2fs%s",
            self.root, len(self._index), self.disk_bytes / 2**20, self.max_bytes / 2**20,
            self.counters.rebuild_seconds, f" (DEGRADED: {self.degraded})" if self.degraded else "",
        )  # fmt: skip
        loop = asyncio.get_running_loop()
        self._writers = [loop.create_task(self._write_loop()) for _ in range(self._io_threads)]

    def _prepare_root(self) -> None:
        (self.root / "v1").mkdir(parents=True, exist_ok=True)
        probe = self.root / f"{TMP_PREFIX}probe-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()

    async def flush(self, timeout_s: float) -> bool:
        """Wait until queued spills are written (True) or the timeout passes."""
        deadline = time.monotonic() + timeout_s
        while (self._queued or self._queue.qsize()) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return not self._queued

    async def close(self) -> None:
        for task in self._writers:
            task.cancel()
        await asyncio.gather(*self._writers, return_exceptions=True)
        self._pool.shutdown(wait=True)

    # -- reads ---------------------------------------------------------------------
    def peek(self, key: ChunkKey) -> bool:
        return key in self._index

    async def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [k in self._index for k in keys]

    def payload_size(self, key: ChunkKey) -> int | None:
        entry = self._index.get(key)
        return None if entry is None else entry.payload_len

    async def get(self, key: ChunkKey, out: memoryview | None = None) -> Chunk | None:
        """The chunk (read into ``out`` when given: exactly payload_size bytes), or None."""
        entry = self._index.get(key)
        if entry is None:
            self.counters.misses += 1
            return None
        try:
            payload = await self._run(read_record, entry.path, key, out)
        except CorruptRecord as err:
            logger.warning("disk tier: %s is damaged (%s); removed, answered as a miss", entry.path, err)
            self.counters.corrupt += 1
            await self._drop(key, entry)
            self.counters.misses += 1
            return None
        except OSError as err:
            logger.warning("disk tier: cannot read %s (%s); answered as a miss", entry.path, err)
            await self._drop(key, entry)
            self.counters.misses += 1
            return None
        if key in self._index:
            self.policy.touched(key)
        self.counters.hits += 1
        return Chunk(payload, self.name)

    # -- writes --------------------------------------------------------------------
    def enqueue(self, key: ChunkKey, data: Any) -> bool:
        """Queue a chunk for writing (write-behind); False if dropped (full, degraded, too big)."""
        size = memoryview(data).nbytes
        if key in self._index or key in self._queued:
            return True
        if (
            self._degraded_now()
            or self._queued_bytes + size > self.max_queue_bytes
            or disk_usage(HEADER_BLOCK + size) > self.max_bytes
        ):
            self.counters.spills_dropped += 1
            return False
        self._queued.add(key)
        self._queued_bytes += size
        self._queue.put_nowait((key, bytes(data)))
        return True

    async def _write_loop(self) -> None:
        while True:
            key, data = await self._queue.get()
            try:
                if not self._degraded_now():
                    if await self._write(key, data) is PutStatus.STORED:
                        self.counters.spills += 1
                else:
                    self.counters.spills_dropped += 1
            finally:
                self._queued.discard(key)
                self._queued_bytes -= len(data)

    async def put(self, key: ChunkKey, data: Any, parent: ChunkKey | None = None) -> PutStatus:
        if key in self._index:
            self.policy.touched(key)
            return PutStatus.EXISTS
        return await self._write(key, data)

    async def _write(self, key: ChunkKey, data: Any) -> PutStatus:
        size = memoryview(data).nbytes
        disk_bytes = disk_usage(HEADER_BLOCK + size)
        if disk_bytes > self.max_bytes:
            return PutStatus.TOO_LARGE
        path = path_for(self.root, key)
        header = encode_header(key.namespace, key.digest, data, pad_to=HEADER_BLOCK)
        try:
            await self._run(write_record, path, header, data, self.fsync)
        except OSError as err:
            self.counters.write_errors += 1
            reason = "disk full" if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "write failed"
            self._degrade(f"{reason}: {err}")
            return PutStatus.NO_SPACE
        if self.degraded:
            logger.info("disk tier writable again; leaving degraded mode")
            self.degraded = None
        if key in self._index:  # written twice concurrently: keep one
            return PutStatus.EXISTS
        self._add(key, _Entry(path, size, disk_bytes))
        self.counters.stores += 1
        await self._shrink_to(self.max_bytes)
        return PutStatus.STORED

    def _degrade(self, reason: str) -> None:
        if self.degraded is None:
            logger.warning("disk tier degraded, serving memory-only for writes: %s (retry every %.0fs)",
                           reason, self.retry_s)  # fmt: skip
        self.degraded = reason
        self._degraded_at = time.monotonic()

    def _degraded_now(self) -> bool:
        """Degraded and not yet due for a retry."""
        return self.degraded is not None and time.monotonic() - self._degraded_at < self.retry_s

    async def _shrink_to(self, limit: int) -> None:
        while self.disk_bytes > limit and (key := self.policy.victim(_never)) is not None:
            entry = self._index[key]
            await self._drop(key, entry)
            self.counters.evictions += 1
            self.counters.evicted_bytes += entry.payload_len

    # -- removal -------------------------------------------------------------------
    def _add(self, key: ChunkKey, entry: _Entry) -> None:
        self._index[key] = entry
        self.policy.inserted(key, entry.payload_len, None)
        self.stored_bytes += entry.payload_len
        self.disk_bytes += entry.disk_bytes
        counts = self._by_namespace.setdefault(key.namespace, [0, 0])
        counts[0] += 1
        counts[1] += entry.payload_len

    async def _drop(self, key: ChunkKey, entry: _Entry) -> None:
        if self._index.get(key) is not entry:
            return
        del self._index[key]
        self.policy.removed(key)
        self.stored_bytes -= entry.payload_len
        self.disk_bytes -= entry.disk_bytes
        counts = self._by_namespace[key.namespace]
        counts[0] -= 1
        counts[1] -= entry.payload_len
        if counts[0] == 0:
            del self._by_namespace[key.namespace]
        try:
            await self._run(unlink, entry.path)
        except OSError as err:
            logger.warning("disk tier: cannot remove %s: %s", entry.path, err)

    async def delete(self, key: ChunkKey) -> bool:
        entry = self._index.get(key)
        if entry is None:
            return False
        await self._drop(key, entry)
        return True

    async def clear(self, namespace: str | None) -> int:
        victims = [(k, e) for k, e in self._index.items() if namespace is None or k.namespace == namespace]
        for key, entry in victims:
            await self._drop(key, entry)
        return len(victims)

    def keys(self) -> list[ChunkKey]:
        return list(self._index)

    def namespaces(self) -> dict[str, tuple[int, int]]:
        return {ns: (c[0], c[1]) for ns, c in self._by_namespace.items()}

    def stats(self) -> dict[str, Any]:
        return {
            "capacity_bytes": self.max_bytes,
            "stored_bytes": self.stored_bytes,
            "disk_bytes": self.disk_bytes,
            "chunks": len(self._index),
            "queued_spills": len(self._queued),
            "queued_bytes": self._queued_bytes,
            "degraded": self.degraded is not None,
            "degraded_reason": self.degraded or "",
            "path": str(self.root),
            **dataclasses.asdict(self.counters),
        }
