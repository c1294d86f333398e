"""The disk tier's lifecycle (:class:`DiskLifecycle`, a base of :class:`.tier.DiskTier`):
start-up and stop.

- ``open`` locks the spill directory (one daemon per directory: a second one
  is refused with :class:`ConfigError`), probes that it is writable and
  whether it takes O_DIRECT, and rebuilds the index: from the snapshot a clean
  stop left (:mod:`.snapshot`), else by scanning the files' headers (damaged
  and stray temp files are removed, :func:`.files.scan`); then it evicts down
  to ``max_bytes`` and the tenants' quotas and starts the writers.  An
  unusable directory degrades the tier instead of failing the start.
- ``flush`` waits for the queued spills; ``close`` stops the writers, saves the
  index snapshot, gives lent spills back and releases the lock.

Primitives: :class:`DiskLifecycle` (``open``, ``flush``, ``close``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any

from lmcache_client.keys import ChunkTokens

from ...config import ConfigError
from ...supervisor import Supervisor
from ..base import ChunkKey
from . import snapshot as disksnapshot
from .files import LOCK_NAME, TMP_PREFIX, DirectoryInUse, direct_io_works, lock_directory, scan
from .index import DiskIndex, _entry

logger = logging.getLogger("lmcache_server.storage.disk.tier")  # the tier's log lines keep their logger name


class DiskLifecycle(DiskIndex):
    """Opening and closing :class:`.tier.DiskTier`; the tier's ``__init__`` sets the
    attributes below and the tier writes (``_write_loop``, ``_degrade``)."""

    direct_io: bool
    direct: bool
    degraded: str | None
    _pool: concurrent.futures.ThreadPoolExecutor
    _writers: list[asyncio.Task[None]]
    _io_threads: int
    _supervisor: Supervisor
    _opened: bool
    _lock_fd: int | None
    _write_loop: Callable[[], Coroutine[Any, Any, None]]
    _degrade: Callable[[str], None]
    scan_tokens: bool
    found_tokens: list[tuple[ChunkKey, ChunkTokens]]

    # -- lifecycle -----------------------------------------------------------------
    async def open(self) -> None:
        """Check the directory, rebuild the index from it, start the writers."""
        started = time.perf_counter()
        try:
            await self._run(self._prepare_root)
        except DirectoryInUse:
            raise ConfigError(
                "local_disk",
                str(self.root),
                "a spill directory no other daemon uses (another daemon holds its lock,"
                f" {self.root / LOCK_NAME}; give each daemon its own directory)",
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
                found, removed = await self._run(scan, self.root, 16, self.scan_tokens)
                self.counters.corrupt += removed
                for _, key, _, payload_len, disk_bytes, tokens in found:
                    self._add(key, _entry(payload_len, disk_bytes))
                    if tokens is not None:
                        self.found_tokens.append((key, tokens))
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
