"""The disk tier's lifecycle (:class:`DiskLifecycle`, a part :class:`.tier.DiskTier` builds and holds):
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
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from lmcache_client.keys import ChunkTokens

from ...config import ConfigError
from ...supervisor import Supervisor
from ..base import ChunkKey
from . import snapshot as disksnapshot
from .files import LOCK_NAME, TMP_PREFIX, DirectoryInUse, direct_io_works, lock_directory, scan
from .index import DiskIndex, _entry

logger = logging.getLogger("lmcache_server.storage.disk.tier")  # the tier's log lines keep their logger name


class DiskLifecycle:
    """Opening and closing :class:`.tier.DiskTier`: its ``index`` (and the
    directory, the bounds and the spills it holds), the I/O threads (``pool``,
    ``run``: one hop to them), ``io_threads`` writers (``write_loop``, supervised);
    ``degrade`` and ``degraded`` are the tier's degraded state."""

    def __init__(
        self,
        index: DiskIndex,
        *,
        pool: concurrent.futures.ThreadPoolExecutor,
        run: Callable[..., Awaitable[Any]],
        supervisor: Supervisor,
        write_loop: Callable[[], Coroutine[Any, Any, None]],
        degrade: Callable[[str], None],
        degraded: Callable[[], str | None],
        io_threads: int,
        direct_io: bool,
        scan_tokens: bool,
        found_tokens: list[tuple[ChunkKey, ChunkTokens]],
    ):
        self.index = index
        self.root = index.root
        self.spills = index.spills
        self.counters = index.counters
        self._pool = pool
        self._run = run
        self._supervisor = supervisor
        self._write_loop = write_loop
        self._degrade = degrade
        self._degraded = degraded
        self._io_threads = io_threads
        self.direct_io = direct_io  # asked for
        self.direct = False  # in use: asked for and the filesystem takes O_DIRECT (see open)
        self.scan_tokens = scan_tokens
        self.found_tokens = found_tokens  # what the scan finds with token ids (with scan_tokens)
        self._writers: list[asyncio.Task[None]] = []
        self.opened = False
        self._lock_fd: int | None = None  # the spill directory's lock (see open)

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
            self.spills.write_direct(self.direct)
            if self.direct_io and not self.direct:
                logger.info("disk tier: %s does not take O_DIRECT; writing through the page cache", self.root)
            snapshot = await self._run(disksnapshot.load, self.root)
            if snapshot is not None:
                entries = [_entry(payload_len, disk_bytes) for payload_len, disk_bytes in snapshot.sizes]
                self.index.add_many(snapshot.keys, list(map(entries.__getitem__, snapshot.size_index)))
                self.counters.rebuilt_entries = len(snapshot)
                self.counters.rebuilt_from_snapshot = 1
            else:
                found, removed = await self._run(scan, self.root, 16, self.scan_tokens)
                self.counters.corrupt += removed
                for _, key, _, payload_len, disk_bytes, tokens in found:
                    self.index.add(key, _entry(payload_len, disk_bytes))
                    if tokens is not None:
                        self.found_tokens.append((key, tokens))
                self.counters.rebuilt_entries = len(found)
            await self.index.shrink_to(self.index.max_bytes)
            for tenant in list(self.index.quotas.limits):  # a quota lowered since the last run
                await self.index.shrink_tenant(f"|tenant={tenant}")
        self.counters.rebuild_seconds = round(time.perf_counter() - started, 3)
        logger.info(
            "disk tier at %s: %d chunks, %.1f MiB of %.1f MiB, index rebuilt (%s) in %.2fs, %s writes%s",
            self.root, len(self.index.entries), self.index.disk_bytes / 2**20, self.index.max_bytes / 2**20,
            "from snapshot" if self.counters.rebuilt_from_snapshot else "scan", self.counters.rebuild_seconds,
            "direct (O_DIRECT)" if self.direct else "buffered",
            f" (DEGRADED: {self._degraded()})" if self._degraded() else "",
        )  # fmt: skip
        self._writers = [self._supervisor.spawn("disk_writer", self._write_loop) for _ in range(self._io_threads)]
        self.opened = True

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
        if self.opened and self._degraded() is None:
            entries = [(key, e.payload_len) for key, e in self.index.entries.items()]
            try:
                await asyncio.get_running_loop().run_in_executor(self._pool, disksnapshot.save, self.root, entries)
            except OSError as err:
                logger.warning("disk tier: no index snapshot written (%s); the next start scans", err)
        self._pool.shutdown(wait=True)
        self.spills.release_all()  # give lent bytes back
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the directory is free for the next daemon
            self._lock_fd = None
