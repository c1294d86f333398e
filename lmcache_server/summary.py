"""The periodic summary: one INFO log line every ``stats_log_interval_s`` seconds.

In the spirit of LMCache's ``Cache hit: 87.3% of 2560 tokens reused``, for
operators who read logs rather than dashboards::

    summary (last 30s): get hit 87.5% of 4096 tokens reused (memory 3072, disk 512); lookup hit 75.0% of 8192 tokens;
    2.1 req/s, in 1.50 MiB/s, out 3.20 MiB/s; memory 96.1% of 5.00 GiB, 12 evictions; 3 clients

(one line in the log).  Tokens are chunks x ``chunk_size``.  The numbers are
deltas over the interval, read from the same counters ``/metrics`` exports.

Primitives: :class:`Snapshot` / :func:`take_snapshot` (the counters at one
moment), :func:`summary_line` (two snapshots -> the line) and
:class:`SummaryLog` (``start`` a task on the event loop, ``close``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from .metrics import ServerMetrics, counter_value
from .storage import TieredStore

logger = logging.getLogger(__name__)

_MIB = 1024**2
_GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Cumulative counters (and a few gauges) at ``at`` (monotonic seconds)."""

    at: float
    reads: int  # chunk reads: every get looks in memory first
    hits: dict[str, int]  # tier -> chunk reads it served
    lookup_chunks: int
    lookup_hit_chunks: int
    requests: float
    received_bytes: float
    sent_bytes: float
    evictions: int  # from memory
    memory_used_bytes: int
    memory_capacity_bytes: int
    uplink_up: bool | None  # None: no remote tier
    dropped_writes: int  # to the remote tier
    clients: int
    uplink: str = "redis"  # the remote tier's name (redis, mooncake)


def take_snapshot(store: TieredStore, metrics: ServerMetrics, clients: int, at: float) -> Snapshot:
    stats = store.stats()
    tiers: dict[str, dict[str, Any]] = stats["tiers"]
    memory = tiers["memory"]
    uplink = "mooncake" if "mooncake" in tiers else "redis"
    remote = tiers.get(uplink)
    return Snapshot(
        at=at,
        reads=int(memory.get("hits", 0)) + int(memory.get("misses", 0)),
        hits={name: int(values.get("hits", 0)) for name, values in tiers.items()},
        lookup_chunks=int(stats["lookup_chunks"]),
        lookup_hit_chunks=int(stats["lookup_hit_chunks"]),
        requests=counter_value(metrics.requests),
        received_bytes=counter_value(metrics.received_bytes),
        sent_bytes=counter_value(metrics.sent_bytes),
        evictions=int(memory.get("evictions", 0)),
        memory_used_bytes=int(memory.get("allocated_bytes", memory.get("stored_bytes", 0))),
        memory_capacity_bytes=int(memory.get("capacity_bytes", 0)),
        uplink_up=None if remote is None else bool(remote.get("up")),
        dropped_writes=int(remote.get("dropped_writes", 0)) if remote is not None else 0,
        uplink=uplink,
        clients=clients,
    )


def _size(n: int) -> str:
    return f"{n / _GIB:.2f} GiB" if n >= _GIB else f"{n / _MIB:.0f} MiB"


def _percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%"


def summary_line(prev: Snapshot, cur: Snapshot, chunk_size: int) -> str:
    """What happened between two snapshots, as one line."""
    elapsed = max(cur.at - prev.at, 1e-9)
    reads = cur.reads - prev.reads
    hits = {tier: n - prev.hits.get(tier, 0) for tier, n in cur.hits.items()}
    hit_chunks = sum(hits.values())
    if reads > 0:
        by_tier = ", ".join(f"{tier} {n * chunk_size}" for tier, n in hits.items() if n > 0)
        get = f"get hit {_percent(hit_chunks, reads)} of {reads * chunk_size} tokens reused" + (
            f" ({by_tier})" if by_tier else ""
        )
    else:
        get = "no chunk reads"
    asked = cur.lookup_chunks - prev.lookup_chunks
    if asked > 0:
        found = cur.lookup_hit_chunks - prev.lookup_hit_chunks
        lookup = f"lookup hit {_percent(found, asked)} of {asked * chunk_size} tokens"
    else:
        lookup = "no lookups"
    rates = (
        f"{(cur.requests - prev.requests) / elapsed:.1f} req/s, "
        f"in {(cur.received_bytes - prev.received_bytes) / elapsed / _MIB:.2f} MiB/s, "
        f"out {(cur.sent_bytes - prev.sent_bytes) / elapsed / _MIB:.2f} MiB/s"
    )
    capacity = max(cur.memory_capacity_bytes, 1)
    memory = (
        f"memory {_percent(cur.memory_used_bytes, capacity)} of {_size(cur.memory_capacity_bytes)}, "
        f"{cur.evictions - prev.evictions} evictions"
    )
    parts = [f"summary (last {elapsed:.0f}s): {get}; {lookup}", rates, memory]
    if cur.uplink_up is not None:
        state = "up" if cur.uplink_up else "DOWN"
        parts.append(f"{cur.uplink} {state}, {cur.dropped_writes - prev.dropped_writes} dropped writes")
    parts.append(f"{cur.clients} client{'' if cur.clients == 1 else 's'}")
    return "; ".join(parts)


class SummaryLog:
    """Logs :func:`summary_line` every ``interval_s`` seconds (0: never), from a task on the event loop."""

    def __init__(
        self,
        store: TieredStore,
        metrics: ServerMetrics,
        clients: Callable[[], int],
        chunk_size: int,
        interval_s: float,
    ):
        self.store = store
        self.metrics = metrics
        self.clients = clients
        self.chunk_size = chunk_size
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def snapshot(self) -> Snapshot:
        return take_snapshot(self.store, self.metrics, self.clients(), time.monotonic())

    def start(self) -> None:
        if self.interval_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        prev = self.snapshot()
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                cur = self.snapshot()
                logger.info("%s", summary_line(prev, cur, self.chunk_size))
                prev = cur
            except Exception:  # a bug here must not stop the daemon; say so once per interval
                logger.exception("could not write the summary line")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
