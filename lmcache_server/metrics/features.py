"""The Prometheus collectors of the daemon's optional parts, read at scrape time from
each part's ``stats`` (so they can never drift from it):

:class:`ShmCollector` (shared-memory leases, server/shm/), :class:`TaskFailureCollector`
(failures of supervised background tasks and of requests that hit a bug),
:class:`PrefetchCollector` (lookups with prefetch, server/prefetch.py),
:class:`EventsCollector` (KV events, events/), :class:`SizingCollector` (the hit
rate an unbounded memory tier would have had beside the actual one,
storage/sizing.py).  Every family is listed in docs/operations.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class ShmCollector(Collector):
    """Exports the shared-memory lease table's counters (server/shm/) at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        s = self.stats()
        yield GaugeMetricFamily(
            "lmcache_shm_enabled", "1 when the pool is shared with local clients.", value=float(s["enabled"])
        )
        # kind: read (get leases), write (alloc leases), staged (slots for a client's next put, see bind)
        families = [
            (GaugeMetricFamily, "lmcache_shm_leases", "Leases held now by shared-memory clients.",
             ("active_read_leases", "active_write_leases", "active_staged_leases")),
            (CounterMetricFamily, "lmcache_shm_leases_granted", "Leases granted to shared-memory clients.",
             ("read_leases", "write_leases", "staged_leases")),
            (CounterMetricFamily, "lmcache_shm_leases_expired",
             "Leases reclaimed after shm_lease_timeout_s (a client died or stalled).",
             ("expired_reads", "expired_writes", "expired_staged")),
            (GaugeMetricFamily, "lmcache_shm_leased_bytes",
             "Bytes held by leases now (write: incl. quarantined and staged; staged: those slots alone).",
             ("leased_bytes", "reserved_bytes", "staged_bytes")),
            (CounterMetricFamily, "lmcache_shm_bytes", "Bytes read and written by clients through the mapped pool.",
             ("read_bytes", "committed_bytes", None)),
        ]  # fmt: skip
        for kind, name, doc, fields in families:
            metric = kind(name, doc, labels=["kind"])
            for label, field in zip(("read", "write", "staged"), fields):
                if field is not None:
                    metric.add_metric([label], float(s[field]))
            yield metric
        yield CounterMetricFamily(
            "lmcache_shm_binds",
            "Shared-memory puts made in one round trip (bind requests into staged slots answered).",
            value=float(s["binds"]),
        )
        yield GaugeMetricFamily(
            "lmcache_shm_quarantined_bytes",
            "Expired write slots held until their writer is known to be done (its late commit, or gone).",
            value=float(s["quarantined_bytes"]),
        )
        freed = CounterMetricFamily(
            "lmcache_shm_quarantine_freed",
            "Quarantined write slots freed: writer came back or died (released), or unobservable (timed_out).",
            labels=["how"],
        )
        freed.add_metric(["released"], float(s["quarantine_released"]))
        freed.add_metric(["timed_out"], float(s["quarantine_timed_out"]))
        yield freed


class TaskFailureCollector(Collector):
    """Exports the supervisor's failure counts (lmcache_server/supervisor.py) at scrape time."""

    def __init__(self, failures: dict[str, int]):
        self.failures = failures

    def collect(self) -> Iterator[Any]:
        metric = CounterMetricFamily(
            "lmcache_background_task_failures",
            "Unexpected failures by task (disk_writer, redis_writer, redis_reconnect, reply_sweeper, shm_sweeper, "
            "put_fill, prefetch, redis_OP, dispatch, 'request OP'); a failed loop is restarted.",
            labels=["task"],
        )
        for task, count in sorted(self.failures.items()):
            metric.add_metric([task], float(count))
        yield metric


class PrefetchCollector(Collector):
    """Exports the prefetcher's counters (server/prefetch.py) at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        s = self.stats()
        families = [
            ("lmcache_prefetches", "Prefetches started (lookups with prefetch: true whose chunks were on disk or "
             "in Redis).", "prefetches"),
            ("lmcache_prefetched_chunks", "Chunks prefetches promoted into memory.", "prefetched_chunks"),
            ("lmcache_prefetched_bytes", "Payload bytes prefetches promoted into memory.", "prefetched_bytes"),
            ("lmcache_prefetches_declined",
             "Prefetches not started or stopped short: no room in the in-flight byte budget, or too many running.",
             "declined"),
            ("lmcache_prefetches_cancelled",
             "Prefetches cancelled: every lookup that joined them sent cancel_prefetch (its request ended first).",
             "cancelled"),
        ]  # fmt: skip
        for name, doc, field in families:
            yield CounterMetricFamily(name, doc, value=float(s[field]))
        yield GaugeMetricFamily(
            "lmcache_prefetch_held_bytes", "Bytes of the in-flight budget prefetches hold now.", value=s["held_bytes"]
        )


class EventsCollector(Collector):
    """Exports the KV-event publisher's counters (lmcache_server/events/) at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        s = self.stats()
        families = [
            ("lmcache_events_published", "KV events sent on the events endpoint.", "events"),
            ("lmcache_event_batches_published", "KV event batches sent (one sequence number each).", "batches"),
            ("lmcache_event_batches_dropped",
             "KV event batches ZeroMQ refused to send (kept for replay); a slow subscriber's own "
             "losses past its high-water mark are silent in ZeroMQ and seen by it as sequence gaps.",
             "dropped_batches"),
            ("lmcache_event_replays", "Replay requests answered.", "replays"),
            ("lmcache_event_chunks_announced", "Chunks announced as BlockStored.", "announced_chunks"),
            ("lmcache_event_chunks_removed", "Announced chunks that left the node (BlockRemoved).", "removed_chunks"),
            ("lmcache_event_chunks_skipped",
             "Chunks with token ids not one chunk's worth or not whole event blocks.", "skipped_chunks"),
            ("lmcache_event_errors", "Unexpected failures while building events (logged).", "errors"),
            ("lmcache_event_chunks_moved",
             "Announced chunks whose medium changed (memory <-> disk).", "moved_chunks"),
            ("lmcache_event_chunks_restored",
             "Chunks announced again at start (kept at the last clean stop, or found on disk with token ids).",
             "restored_chunks"),
            ("lmcache_event_heartbeats", "Heartbeat batches sent (one per topic when idle).", "heartbeats"),
            ("lmcache_event_snapshots", "Snapshots answered in full on the snapshot endpoint.", "snapshots"),
            ("lmcache_event_chunks_remote",
             "Chunks that left memory and disk announced as held in Redis (locality REMOTE).", "remote_moved_chunks"),
            ("lmcache_event_chunks_remote_removed",
             "Chunks announced REMOTE whose removal was announced (TTL, gone from Redis, uplink down, bound).",
             "remote_removed_chunks"),
            ("lmcache_event_remote_audits", "Audit rounds of the chunks announced REMOTE (EXISTS in Redis).",
             "remote_audits"),
        ]  # fmt: skip
        for name, doc, field in families:
            yield CounterMetricFamily(name, doc, value=float(s.get(field, 0)))
        yield GaugeMetricFamily(
            "lmcache_event_announced_blocks", "Blocks announced and not removed.", value=float(s["announced_blocks"])
        )
        yield GaugeMetricFamily(
            "lmcache_event_remote_known_chunks",
            "Keys this node remembers Redis holds for it (bounded by events_remote_max_chunks).",
            value=float(s.get("remote_known_chunks", 0)),
        )
        yield GaugeMetricFamily(
            "lmcache_event_kept_bytes",
            "Bytes of token ids and block hashes kept for the announced chunks (snapshots, medium changes).",
            value=float(s.get("kept_bytes", 0)),
        )


class SizingCollector(Collector):
    """Exports the sizing telemetry (storage/sizing.py) at scrape time: per stream
    (``op``: lookup, get) the window's hit-rate ceiling, actual hit rate and counts.
    Gauges holding a fraction end in ``_ratio`` (Prometheus naming)."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        s = self.stats()
        families = [
            ("lmcache_hit_rate_ceiling_ratio",
             "Hit rate an unbounded memory tier would have had over the window: (accesses - distinct chunks) / "
             "accesses (distinct counted by a HyperLogLog sketch, see lmcache_hit_rate_sketch_error_ratio).",
             "ceiling"),
            ("lmcache_hit_rate_window_ratio", "The memory tier's hit rate over the same window.", "actual"),
            ("lmcache_hit_rate_window_accesses",
             "Chunk accesses the window covers (sizing_window_chunks to twice that).", "accesses"),
            ("lmcache_hit_rate_window_distinct_chunks",
             "Distinct chunks accessed in the window (estimated): the working set an unbounded tier would hold.",
             "distinct"),
        ]  # fmt: skip
        for name, doc, field in families:
            metric = GaugeMetricFamily(name, doc, labels=["op"])
            for op in ("lookup", "get"):
                metric.add_metric([op], float(s[op][field]))
            yield metric
        yield GaugeMetricFamily(
            "lmcache_hit_rate_sketch_error_ratio",
            "Relative standard error of the distinct count (1.04 / sqrt(registers)); the ceiling's absolute "
            "standard error is this times distinct / accesses.",
            value=float(s["relative_error"]),
        )
