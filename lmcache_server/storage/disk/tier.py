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
  spill and counts it.  A spill is either *lent* (a pool extent, written from
  where it is and released when written) or copied into a page-aligned buffer.
  Queued chunks are served from the queue until written; deleting one cancels
  its write (the queue itself: :mod:`.spillqueue`).
- With ``direct_io`` (and a filesystem that takes it) files are written with
  O_DIRECT, straight from pool memory to the device: no page-cache copy;
  reads stay buffered and drop the file's pages after, so nothing is cached
  twice (see :mod:`.files`).
- Reads verify the header, the namespace, the key and the payload checksum; a
  damaged, truncated or foreign file is a miss, is deleted and is counted.
- On open the index is rebuilt from the directory (headers only), so the cache
  survives restarts.  Bounded by ``max_bytes`` (bytes on disk, 4 KiB blocks, as
  ``du`` counts them); which chunk leaves is its own eviction policy's choice
  (:mod:`.policy`, the same interface as the memory tier's; LRU unless given
  one), told about inserts, hits and removals.  Rebuilt entries are inserted
  oldest first, so an LRU policy starts in file-age order.
- One daemon per directory: ``open`` takes an exclusive ``flock`` on
  ``<root>/lmcache.lock`` (held until exit) and a second daemon on the same
  directory refuses to start (:class:`ConfigError`: exit code 2), since each
  would delete the other's temp files and evict its chunks.
- An unwritable directory or a full disk degrades the tier (log once, metric);
  writes are retried every ``retry_s`` and the daemon keeps serving.

All file I/O runs on a small bounded thread pool (one hop per chunk:
open+write+fsync+rename, or open+read+verify), which aiofiles' one hop per
call would multiply.

:class:`DiskTier` is a front that builds and holds its parts: its index
(``index``, :class:`.index.DiskIndex`: the entries, the byte counts, eviction,
removal) and its lifecycle (``lifecycle``, :class:`.lifecycle.DiskLifecycle`:
open with the lock and the index rebuilt from the snapshot or a scan; flush;
close).  The tier itself holds the I/O threads, the degraded state, the reads
and the writes.

Primitives: ``open``, ``get``, ``put``, ``enqueue``, ``accepts``, ``peek``, ``peek_many``,
``contains``, ``delete``, ``clear``, ``keys``, ``namespaces``, ``stats``, ``flush``, ``close``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import errno
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lmcache_client.keys import ChunkTokens
from lmcache_client.protocol import PutStatus

from ...supervisor import Supervisor
from ..base import Chunk, ChunkKey, TierLinks
from ..chunkfile import CorruptRecord
from ..policy import EvictionPolicy, LRUPolicy
from ..tenants import TenantQuotas
from .files import HEADER_BLOCK, disk_usage, path_for, read_record, write_record
from .index import DiskCounters as DiskCounters  # re-exported
from .index import DiskIndex, _entry
from .lifecycle import DiskLifecycle
from .spillqueue import SpillQueue

logger = logging.getLogger(__name__)


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
        direct_io: bool = True,
        supervisor: Supervisor | None = None,
        links: TierLinks | None = None,
        quotas: TenantQuotas | None = None,
        scan_tokens: bool = False,
    ):
        self.root = root
        self.fsync = fsync
        self.retry_s = retry_s
        self.counters = DiskCounters()
        self.quotas = quotas if quotas is not None else TenantQuotas()
        """Per-tenant limits on bytes on disk (``tenant_quotas``)."""
        self.policy = policy if policy is not None else LRUPolicy()
        self.degraded: str | None = None
        self._degraded_at = 0.0
        self._pool = concurrent.futures.ThreadPoolExecutor(io_threads, thread_name_prefix="lmcache-disk")
        self._io = asyncio.Semaphore(io_threads * 2)
        self.spills = SpillQueue(max_queue_bytes)
        """Spills waiting to be written (readable meanwhile)."""
        self.links = links if links is not None else TierLinks()
        """The store that holds the tier is told on it when a chunk is no longer readable
        here (dropped, deleted, a spill not written), and gives a chunk's token ids for its
        record (KV events) (:class:`..base.TierLinks`)."""
        self.found_tokens: list[tuple[ChunkKey, ChunkTokens]] = []
        """What the start's scan found with token ids (oldest first, with ``scan_tokens``);
        taken by the announcer."""
        self.index = DiskIndex(
            root,
            max_bytes,
            counters=self.counters,
            quotas=self.quotas,
            policy=self.policy,
            spills=self.spills,
            links=self.links,
            run=self._run,
        )
        self.lifecycle = DiskLifecycle(
            self.index,
            pool=self._pool,
            run=self._run,
            supervisor=supervisor if supervisor is not None else Supervisor(),
            write_loop=self._write_loop,
            degrade=self._degrade,
            degraded=lambda: self.degraded,
            io_threads=io_threads,
            direct_io=direct_io,
            scan_tokens=scan_tokens,
            found_tokens=self.found_tokens,
        )

    # -- the parts' state, read by the store, the metrics and the tests ---------------
    @property
    def direct(self) -> bool:
        """Writes with O_DIRECT: asked for and the filesystem takes it (see open)."""
        return self.lifecycle.direct

    @property
    def max_bytes(self) -> int:
        """The bound on bytes on disk (the index's)."""
        return self.index.max_bytes

    @property
    def stored_bytes(self) -> int:
        return self.index.stored_bytes

    @property
    def disk_bytes(self) -> int:
        return self.index.disk_bytes

    # -- lifecycle (:mod:`.lifecycle`) -----------------------------------------------
    async def open(self) -> None:
        """Check the directory, rebuild the index from it, start the writers."""
        await self.lifecycle.open()

    async def flush(self, timeout_s: float) -> bool:
        """Wait until queued spills are written (True) or the timeout passes."""
        return await self.lifecycle.flush(timeout_s)

    async def close(self) -> None:
        """Stop the writers (call :meth:`flush` first to drain them) and leave an
        index snapshot for a fast restart."""
        await self.lifecycle.close()

    # -- the index (:mod:`.index`) ---------------------------------------------------
    def victim_for(self, size: int) -> ChunkKey | None:
        return self.index.victim_for(size)

    async def delete(self, key: ChunkKey) -> bool:
        return await self.index.delete(key)

    async def clear(self, namespace: str | None) -> int:
        return await self.index.clear(namespace)

    def keys(self) -> list[ChunkKey]:
        return self.index.keys()

    def namespaces(self) -> dict[str, tuple[int, int]]:
        return self.index.namespaces()

    async def _run(self, fn: Any, *args: Any) -> Any:
        async with self._io:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # -- reads ---------------------------------------------------------------------
    def peek(self, key: ChunkKey) -> bool:
        return key in self.index.entries or key in self.spills

    def peek_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        index, spills = self.index.entries, self.spills
        return [key in index or key in spills for key in keys]

    async def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [self.peek(k) for k in keys]

    def payload_size(self, key: ChunkKey) -> int | None:
        entry = self.index.entries.get(key)
        if entry is not None:
            return entry.payload_len
        pending = self.spills.get(key)
        return None if pending is None else pending.nbytes

    async def get(self, key: ChunkKey, out: memoryview | None = None) -> Chunk | None:
        """The chunk (read into ``out`` when given: exactly payload_size bytes), or None."""
        entry = self.index.entries.get(key)
        if entry is None:
            pending = self.spills.get(key)
            if pending is None or (out is not None and out.nbytes != pending.nbytes):
                self.counters.misses += 1
                return None
            # Evicted from memory, not yet written: these bytes are the chunk.
            copy = memoryview(bytearray(pending.nbytes)) if out is None else out
            copy[:] = pending
            self.counters.hits += 1
            return Chunk(copy, self.name)
        path = path_for(self.root, key)
        self.index.reading[key] = self.index.reading.get(key, 0) + 1
        try:
            payload = await self._run(read_record, path, key, out, self.direct)
        except (CorruptRecord, OSError) as err:
            changed = key in self.index.changed  # deleted and written again meanwhile: the new file stays
            if isinstance(err, CorruptRecord):
                logger.warning("disk tier: %s is damaged (%s); %s, answered as a miss",
                               path, err, "rewritten meanwhile" if changed else "removed")  # fmt: skip
                self.counters.corrupt += 1
            else:
                logger.warning("disk tier: cannot read %s (%s); answered as a miss", path, err)
            if not changed:
                await self.index.drop(key, entry)
            self.counters.misses += 1
            return None
        finally:
            left = self.index.reading.pop(key) - 1
            if left:
                self.index.reading[key] = left
            else:
                self.index.changed.discard(key)
        if key in self.index.entries:
            self.policy.touched(key)
        self.counters.hits += 1
        return Chunk(payload, self.name)

    # -- writes --------------------------------------------------------------------
    def enqueue(self, key: ChunkKey, data: Any, release: Callable[[], None] | None = None) -> bool:
        """Queue a chunk for writing (write-behind); False if dropped (full, degraded, too big).

        Without ``release`` the bytes are copied now.  With it they are *lent*:
        written straight from where they are (a pool extent), so they must stay
        unchanged until ``release()``, which is called exactly once, when the
        write is done or the spill dropped.
        """
        view = memoryview(data).cast("B")
        size = view.nbytes
        if key in self.index.entries or key in self.spills:
            if release is not None:
                release()
            return True
        if not self.accepts(size):
            self.counters.spills_dropped += 1
            if release is not None:
                release()
            return False
        if release is None:
            view = self.spills.copy(view)
        else:
            self.counters.spills_lent += 1
        self.spills.add(key, view, release)
        return True

    def accepts(self, size: int) -> bool:
        """Whether a spill of ``size`` bytes would be queued now (not dropped)."""
        return (
            not self._degraded_now()
            and self.spills.fits(size)
            and disk_usage(HEADER_BLOCK + size) <= self.index.max_bytes
        )

    async def _write_loop(self) -> None:
        while True:
            key, data, release = await self.spills.next()
            try:
                if not self.spills.is_current(key, data):
                    continue  # deleted while queued
                if self._degraded_now():
                    self.counters.spills_dropped += 1
                elif await self._write(key, data) is PutStatus.STORED:
                    self.counters.spills += 1
                    if not self.spills.is_current(key, data):  # deleted while being written
                        await self.delete(key)
            finally:
                self.spills.done(key, data, release)
                self.index.left(key)

    async def put(self, key: ChunkKey, data: Any, parent: ChunkKey | None = None) -> PutStatus:
        if key in self.index.entries:
            self.policy.touched(key)
            return PutStatus.EXISTS
        return await self._write(key, data)

    async def _write(self, key: ChunkKey, data: Any) -> PutStatus:
        size = memoryview(data).nbytes
        disk_bytes = disk_usage(HEADER_BLOCK + size)
        if disk_bytes > self.index.max_bytes:
            return PutStatus.TOO_LARGE
        path = path_for(self.root, key)
        tokens = self.links.tokens_of(key)
        try:
            written = await self._run(write_record, path, key, data, self.fsync, self.direct, tokens)
        except OSError as err:
            self.counters.write_errors += 1
            reason = "disk full" if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "write failed"
            self._degrade(f"{reason}: {err}")
            return PutStatus.NO_SPACE
        if self.degraded:
            logger.info("disk tier writable again; leaving degraded mode")
            self.degraded = None
        if key in self.index.entries:  # written twice concurrently: keep one
            return PutStatus.EXISTS
        self.index.add(key, _entry(size, disk_usage(written)))
        self.counters.stores += 1
        await self.index.shrink_to(self.index.max_bytes)
        if self.quotas:
            await self.index.shrink_tenant(key.namespace)
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

    def stats(self) -> dict[str, Any]:
        return {
            "capacity_bytes": self.index.max_bytes,
            "stored_bytes": self.stored_bytes,
            "disk_bytes": self.disk_bytes,
            "chunks": len(self.index.entries),
            "queued_spills": len(self.spills),
            "queued_bytes": self.spills.nbytes,
            "direct_io": self.direct,
            "degraded": self.degraded is not None,
            "degraded_reason": self.degraded or "",
            "path": str(self.root),
            **({"tenants": self.quotas.stats()} if self.quotas else {}),
            **dataclasses.asdict(self.counters),
        }
