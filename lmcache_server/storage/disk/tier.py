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
  twice (see :mod:`.diskfiles`).
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
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import errno
import logging
import operator
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lmcache_client.protocol import PutStatus

from ...config import ConfigError
from ...supervisor import Supervisor
from ..base import Chunk, ChunkKey
from ..chunkfile import CorruptRecord
from ..policy import EvictionPolicy, LRUPolicy
from ..tenants import TenantQuotas, tenant_of
from . import snapshot as disksnapshot
from .files import (
    HEADER_BLOCK,
    LOCK_NAME,
    TMP_PREFIX,
    DirectoryInUse,
    direct_io_works,
    disk_usage,
    lock_directory,
    path_for,
    read_record,
    scan,
    unlink,
    write_record,
)
from .spillqueue import SpillQueue

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True, frozen=True)
class _Entry:
    """A chunk's sizes; its file is ``path_for(root, key)``, so no path is kept (a
    million paths are 150 MB).  Shared between the chunks of one size: see :func:`_entry`."""

    payload_len: int
    disk_bytes: int


_entries: dict[tuple[int, int], _Entry] = {}


def _entry(payload_len: int, disk_bytes: int) -> _Entry:
    """The one entry of these sizes (chunks of a model are one size: no object per chunk)."""
    entry = _entries.get((payload_len, disk_bytes))
    if entry is None:
        entry = _Entry(payload_len, disk_bytes)
        if len(_entries) < 4096:
            _entries[(payload_len, disk_bytes)] = entry
    return entry


@dataclasses.dataclass
class DiskCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    stores: int = 0
    spills: int = 0
    spills_lent: int = 0  # queued without a copy: written straight from the memory pool
    spills_dropped: int = 0
    write_errors: int = 0
    corrupt: int = 0
    rebuilt_entries: int = 0
    rebuilt_from_snapshot: int = 0  # 1: the index came from the snapshot of a clean shutdown
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
        direct_io: bool = True,
        spill_ahead_bytes: int = 0,
        supervisor: Supervisor | None = None,
    ):
        self.root = root
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.retry_s = retry_s
        self.direct_io = direct_io  # asked for
        self.direct = False  # in use: asked for and the filesystem takes O_DIRECT (see open)
        self.spill_ahead_bytes = spill_ahead_bytes  # how far ahead the memory tier lends us chunks
        self.counters = DiskCounters()
        self.quotas = TenantQuotas()
        """Per-tenant limits on bytes on disk (``tenant_quotas``); set before :meth:`open`."""
        self.policy = policy if policy is not None else LRUPolicy()
        self.degraded: str | None = None
        self._degraded_at = 0.0
        self._index: dict[ChunkKey, _Entry] = {}
        self._by_namespace: dict[str, list[int]] = {}
        # Keys with reads in flight (how many), and those of them stored or dropped since
        # a read began: a read that fails then found the old file, and the new one stays.
        self._reading: dict[ChunkKey, int] = {}
        self._changed: set[ChunkKey] = set()
        self.stored_bytes = 0  # payload bytes
        self.disk_bytes = 0  # as du counts them
        self._pool = concurrent.futures.ThreadPoolExecutor(io_threads, thread_name_prefix="lmcache-disk")
        self._io = asyncio.Semaphore(io_threads * 2)
        self.spills = SpillQueue(max_queue_bytes)
        """Spills waiting to be written (readable meanwhile)."""
        self._writers: list[asyncio.Task[None]] = []
        self._io_threads = io_threads
        self._supervisor = supervisor if supervisor is not None else Supervisor()
        self._opened = False
        self._lock_fd: int | None = None  # the spill directory's lock (see open)
        self.on_removed: Callable[[ChunkKey], None] | None = None
        """Called when a chunk is no longer readable here (dropped, deleted, a spill
        not written); set by the tiered store."""

    async def _run(self, fn: Any, *args: Any) -> Any:
        async with self._io:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # -- lifecycle -----------------------------------------------------------------
    async def open(self) -> None:
        """Check the directory, rebuild the index from it, start the writers."""
        started = time.perf_counter()
        try:
            await self._run(self._prepare_root)
        except DirectoryInUse:
            raise ConfigError(
                "local_disk", str(self.root), "a spill directory no other daemon uses (another daemon holds its lock,"
                f" {self.root / LOCK_NAME}; give each daemon its own directory)"
            ) from None
        except OSError as err:
            self._degrade(f"directory {self.root} is not usable ({err})")
        else:
            self.direct = self.direct_io and await self._run(direct_io_works, str(self.root / "v1"))
            self.spills.direct = self.direct
            if self.direct_io and not self.direct:
                logger.info("disk tier: %s does not take O_DIRECT; writing through the page cache", self.root)
            snapshot = await self._run(disksnapshot.load, self.root)
            if snapshot is not None:
                entries = [_entry(payload_len, disk_bytes) for payload_len, disk_bytes in snapshot.sizes]
                self._add_many(snapshot.keys, list(map(entries.__getitem__, snapshot.size_index)))
                self.counters.rebuilt_entries = len(snapshot)
                self.counters.rebuilt_from_snapshot = 1
            else:
                found, removed = await self._run(scan, self.root)
                self.counters.corrupt += removed
                for _, key, _, payload_len, disk_bytes in found:
                    self._add(key, _entry(payload_len, disk_bytes))
                self.counters.rebuilt_entries = len(found)
            await self._shrink_to(self.max_bytes)
            for tenant in list(self.quotas.limits):  # a quota lowered since the last run
                await self._shrink_tenant(f"|tenant={tenant}")
        self.counters.rebuild_seconds = round(time.perf_counter() - started, 3)
        logger.info(
            "disk tier at %s: %d chunks, %.1f MiB of %.1f MiB, index rebuilt (%s) in %.2fs, %s writes%s",
            self.root, len(self._index), self.disk_bytes / 2**20, self.max_bytes / 2**20,
            "from snapshot" if self.counters.rebuilt_from_snapshot else "scan", self.counters.rebuild_seconds,
            "direct (O_DIRECT)" if self.direct else "buffered",
            f" (DEGRADED: {self.degraded})" if self.degraded else "",
        )  # fmt: skip
        self._writers = [self._supervisor.spawn("disk_writer", self._write_loop) for _ in range(self._io_threads)]
        self._opened = True

    def _prepare_root(self) -> None:
        if self._lock_fd is None:
            self._lock_fd = lock_directory(self.root)
        (self.root / "v1").mkdir(parents=True, exist_ok=True)
        probe = self.root / f"{TMP_PREFIX}probe-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()

    async def flush(self, timeout_s: float) -> bool:
        """Wait until queued spills are written (True) or the timeout passes."""
        deadline = time.monotonic() + timeout_s
        while not self.spills.idle() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return not len(self.spills)

    async def close(self) -> None:
        """Stop the writers (call :meth:`flush` first to drain them) and leave an
        index snapshot for a fast restart."""
        for task in self._writers:
            task.cancel()
        await asyncio.gather(*self._writers, return_exceptions=True)
        if self._opened and self.degraded is None:
            entries = [(key, e.payload_len) for key, e in self._index.items()]
            try:
                await asyncio.get_running_loop().run_in_executor(self._pool, disksnapshot.save, self.root, entries)
            except OSError as err:
                logger.warning("disk tier: no index snapshot written (%s); the next start scans", err)
        self._pool.shutdown(wait=True)
        self.spills.release_all()  # give lent bytes back
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the directory is free for the next daemon
            self._lock_fd = None

    # -- reads ---------------------------------------------------------------------
    def peek(self, key: ChunkKey) -> bool:
        return key in self._index or key in self.spills

    def peek_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        index, spills = self._index, self.spills
        return [key in index or key in spills for key in keys]

    async def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [self.peek(k) for k in keys]

    def payload_size(self, key: ChunkKey) -> int | None:
        entry = self._index.get(key)
        if entry is not None:
            return entry.payload_len
        pending = self.spills.get(key)
        return None if pending is None else pending.nbytes

    async def get(self, key: ChunkKey, out: memoryview | None = None) -> Chunk | None:
        """The chunk (read into ``out`` when given: exactly payload_size bytes), or None."""
        entry = self._index.get(key)
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
        self._reading[key] = self._reading.get(key, 0) + 1
        try:
            payload = await self._run(read_record, path, key, out, self.direct)
        except (CorruptRecord, OSError) as err:
            changed = key in self._changed  # deleted and written again meanwhile: the new file stays
            if isinstance(err, CorruptRecord):
                logger.warning("disk tier: %s is damaged (%s); %s, answered as a miss",
                               path, err, "rewritten meanwhile" if changed else "removed")  # fmt: skip
                self.counters.corrupt += 1
            else:
                logger.warning("disk tier: cannot read %s (%s); answered as a miss", path, err)
            if not changed:
                await self._drop(key, entry)
            self.counters.misses += 1
            return None
        finally:
            left = self._reading.pop(key) - 1
            if left:
                self._reading[key] = left
            else:
                self._changed.discard(key)
        if key in self._index:
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
        if key in self._index or key in self.spills:
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
        return not self._degraded_now() and self.spills.fits(size) and disk_usage(HEADER_BLOCK + size) <= self.max_bytes

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
                self._left(key)

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
        try:
            await self._run(write_record, path, key, data, self.fsync, self.direct)
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
        self._add(key, _entry(size, disk_bytes))
        self.counters.stores += 1
        await self._shrink_to(self.max_bytes)
        if self.quotas:
            await self._shrink_tenant(key.namespace)
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

    async def _shrink_tenant(self, namespace: str) -> None:
        """Evict the namespace's tenant's own chunks while it is over its quota."""
        found = self.quotas.limit_for(namespace)
        if found is None:
            return
        tenant, limit = found

        def not_theirs(k: ChunkKey) -> bool:
            return tenant_of(k.namespace) != tenant

        while self.quotas.used(tenant) > limit and (key := self.policy.victim(not_theirs)) is not None:
            entry = self._index[key]
            await self._drop(key, entry)
            self.counters.evictions += 1
            self.counters.evicted_bytes += entry.payload_len
            self.quotas.evictions[tenant] += 1

    async def _shrink_to(self, limit: int) -> None:
        while self.disk_bytes > limit and (key := self.policy.victim(_never)) is not None:
            entry = self._index[key]
            await self._drop(key, entry)
            self.counters.evictions += 1
            self.counters.evicted_bytes += entry.payload_len

    # -- removal -------------------------------------------------------------------
    def _left(self, key: ChunkKey) -> None:
        """Tell ``on_removed`` when ``key`` is neither indexed nor queued any more."""
        if self.on_removed is not None and key not in self._index and key not in self.spills:
            self.on_removed(key)

    def _add(self, key: ChunkKey, entry: _Entry) -> None:
        namespace = sys.intern(key.namespace)  # one string per namespace, not one per chunk
        if namespace is not key.namespace:
            key = ChunkKey(namespace, key.digest)
        self._index[key] = entry
        if key in self._reading:
            self._changed.add(key)
        self.policy.inserted(key, entry.payload_len, None)
        self.stored_bytes += entry.payload_len
        self.disk_bytes += entry.disk_bytes
        self.quotas.account(key.namespace, entry.disk_bytes)
        counts = self._by_namespace.setdefault(key.namespace, [0, 0])
        counts[0] += 1
        counts[1] += entry.payload_len

    def _add_many(self, keys: list[ChunkKey], entries: list[_Entry]) -> None:
        """:meth:`_add` of each ``(keys[i], entries[i])`` in order, in bulk (a restart
        from the snapshot: a million entries): the index and the policy take them
        in one call each, the byte counts are summed per namespace and entry.
        ``keys`` carry interned namespaces (storage/disk/snapshot.py)."""
        fresh = dict(zip(keys, entries))
        if len(fresh) != len(keys) or any(map(self._index.__contains__, keys)):
            for key, entry in zip(keys, entries):  # a key twice, or one indexed already: one by one
                self._add(key, entry)
            return
        if self._index:
            self._index.update(fresh)
        else:
            self._index = fresh
        inserted_many = getattr(self.policy, "inserted_many", None)
        if inserted_many is not None:
            inserted_many(keys)
        else:
            for key, entry in zip(keys, entries):
                self.policy.inserted(key, entry.payload_len, None)
        by_namespace = collections.Counter(zip(map(operator.attrgetter("namespace"), keys), map(id, entries)))
        kinds = dict(zip(map(id, entries), entries))  # the entries are shared per size: a few kinds
        for (namespace, kind), n in by_namespace.items():
            entry = kinds[kind]
            self.stored_bytes += n * entry.payload_len
            self.disk_bytes += n * entry.disk_bytes
            self.quotas.account(namespace, n * entry.disk_bytes)
            counts = self._by_namespace.setdefault(namespace, [0, 0])
            counts[0] += n
            counts[1] += n * entry.payload_len

    async def _drop(self, key: ChunkKey, entry: _Entry) -> None:
        if self._index.get(key) is not entry:
            return
        del self._index[key]
        if key in self._reading:
            self._changed.add(key)
        self.policy.removed(key)
        self.stored_bytes -= entry.payload_len
        self.disk_bytes -= entry.disk_bytes
        self.quotas.account(key.namespace, -entry.disk_bytes)
        counts = self._by_namespace[key.namespace]
        counts[0] -= 1
        counts[1] -= entry.payload_len
        if counts[0] == 0:
            del self._by_namespace[key.namespace]
        self._left(key)
        try:
            await self._run(unlink, path_for(self.root, key))
        except OSError as err:
            logger.warning("disk tier: cannot remove %s: %s", path_for(self.root, key), err)

    async def delete(self, key: ChunkKey) -> bool:
        queued = self.spills.cancel(key)  # the writer skips it
        entry = self._index.get(key)
        if entry is None:
            self._left(key)
            return queued
        await self._drop(key, entry)
        return True

    async def clear(self, namespace: str | None) -> int:
        queued = self.spills.cancel_namespace(namespace)
        for key in queued:
            self._left(key)
        victims = [(k, e) for k, e in self._index.items() if namespace is None or k.namespace == namespace]
        for key, entry in victims:
            await self._drop(key, entry)
        return len(set(queued) | {k for k, _ in victims})

    def keys(self) -> list[ChunkKey]:
        return [*self._index, *(k for k in self.spills if k not in self._index)]

    def namespaces(self) -> dict[str, tuple[int, int]]:
        return {ns: (c[0], c[1]) for ns, c in self._by_namespace.items()}

    def stats(self) -> dict[str, Any]:
        return {
            "capacity_bytes": self.max_bytes,
            "stored_bytes": self.stored_bytes,
            "disk_bytes": self.disk_bytes,
            "chunks": len(self._index),
            "queued_spills": len(self.spills),
            "queued_bytes": self.spills.nbytes,
            "direct_io": self.direct,
            "degraded": self.degraded is not None,
            "degraded_reason": self.degraded or "",
            "path": str(self.root),
            **({"tenants": self.quotas.stats()} if self.quotas else {}),
            **dataclasses.asdict(self.counters),
        }
