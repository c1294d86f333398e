"""Prometheus metrics, on a registry the composition root injects (no globals).

Primitives: :class:`ServerMetrics` (request counters and latency histograms,
updated by the server; connection counts, updated by the socket monitor;
build info and process metrics) and :class:`StoreCollector` (tier gauges and
counters read from the store at scrape time, so they can never drift from it),
and :func:`counter_value` (a counter's current total, for the summary log).
The collectors of the optional parts (shared memory, supervised tasks,
prefetch, KV events, sizing) are in :mod:`.features`, re-exported here.

Every family is listed in docs/operations.md; deploy/prometheus/rules.yml and
deploy/grafana/lmcache.json use them (tests check that they name only these).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .. import __version__
from ..storage import TieredStore
from .features import EventsCollector as EventsCollector  # re-exported
from .features import PrefetchCollector as PrefetchCollector  # re-exported
from .features import ShmCollector as ShmCollector  # re-exported
from .features import SizingCollector as SizingCollector  # re-exported
from .features import TaskFailureCollector as TaskFailureCollector  # re-exported

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.requests = Counter(
            "lmcache_requests",
            "Requests handled, by op and outcome (ok or an error code name).",
            ["op", "outcome"],
            registry=registry,
        )
        self._per_request: dict[tuple[str, str], tuple[Any, Any]] = {}
        self.latency = Histogram(
            "lmcache_request_duration_seconds",
            "Time from receiving a request to queueing its reply.",
            ["op"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.received_bytes = Counter(
            "lmcache_received_payload_bytes",
            "Chunk bytes received (puts: payload frames and shared-memory commits).",
            registry=registry,
        )
        self.sent_bytes = Counter(
            "lmcache_sent_payload_bytes",
            "Chunk bytes served (gets: payload frames and shared-memory read leases).",
            registry=registry,
        )
        self.busy = Counter(
            "lmcache_busy_rejections", "Requests answered BUSY (in-flight budget spent).", registry=registry
        )
        self.connected_clients = Gauge(
            "lmcache_connected_clients", "Client connections open now (ZeroMQ peers, tcp and ipc).", registry=registry
        )
        self.connections = Counter(
            "lmcache_client_connections", "Client connections accepted since start.", registry=registry
        )
        self.disconnections = Counter(
            "lmcache_client_disconnections",
            "Client connections closed since start (by the client, or dropped by the heartbeat).",
            registry=registry,
        )
        # Security and input limits (docs/security.md): one series per kind of violation.
        self.limit_violations = Counter(
            "lmcache_limit_violations",
            "Requests refused by an input or per-client limit, by limit "
            "(header_bytes, message_bytes, frames, keys, msgpack, client_requests, client_bytes, "
            "key_requests, key_bytes, fair_share).",
            ["limit"],
            registry=registry,
        )
        self.auth_rejections = Counter(
            "lmcache_auth_rejections",
            "CURVE handshakes refused because the client key is not in client_keys_file.",
            registry=registry,
        )
        self.handshake_failures = Counter(
            "lmcache_handshake_failures",
            "Connections whose ZeroMQ handshake failed, by reason (auth, protocol: e.g. no CURVE, other).",
            ["reason"],
            registry=registry,
        )
        self.key_reloads = Counter(
            "lmcache_client_keys_reloads",
            "Reloads of client_keys_file on SIGHUP, by result (ok; error: the file was refused, the old keys stay).",
            ["result"],
            registry=registry,
        )
        self.forbidden = Counter(
            "lmcache_forbidden_requests",
            "Requests answered FORBIDDEN (outside the client key's grants), by client name.",
            ["client"],
            registry=registry,
        )
        build = Gauge("lmcache_build_info", "Always 1; the version as a label.", ["version"], registry=registry)
        build.labels(__version__).set(1)
        # process_* (RSS, CPU seconds, open fds, start time) on the same registry.
        ProcessCollector(registry=registry)

    def observe(self, op: str, outcome: str, seconds: float) -> None:
        """Count one answered request and its latency (the labelled children are
        looked up once per (op, outcome): ``labels()`` costs more than the update)."""
        try:
            counter, histogram = self._per_request[(op, outcome)]
        except KeyError:
            counter, histogram = self.requests.labels(op, outcome), self.latency.labels(op)
            self._per_request[(op, outcome)] = (counter, histogram)
        counter.inc()
        histogram.observe(seconds)


_C, _G = CounterMetricFamily, GaugeMetricFamily
_TIER_FAMILIES: list[tuple[type, str, str, tuple[str, ...]]] = [
    # (kind, name, help, the tier-stats fields it reads: the first one present)
    (_C, "lmcache_tier_hits", "Chunk reads served by the tier.", ("hits",)),
    (_C, "lmcache_tier_misses", "Chunk reads the tier missed.", ("misses",)),
    (_C, "lmcache_tier_evictions", "Chunks evicted from the tier.", ("evictions",)),
    (_C, "lmcache_tier_evicted_bytes", "Bytes evicted from the tier.", ("evicted_bytes",)),
    (_C, "lmcache_tier_rejected_puts", "Puts the tier could not store.", ("rejections",)),
    (_C, "lmcache_tier_promotions", "Hits in the tier copied up into memory.", ("promotions",)),
    (_C, "lmcache_tier_spills", "Chunks evicted from memory written to the tier.", ("spills",)),
    (_C, "lmcache_tier_spills_dropped", "Evicted chunks not written (queue full, degraded, too large).",
     ("spills_dropped",)),
    (_C, "lmcache_tier_corrupt", "Damaged or foreign records found (served as misses).", ("corrupt",)),
    (_C, "lmcache_tier_write_errors", "Failed writes to the tier.", ("write_errors",)),
    (_C, "lmcache_tier_read_errors", "Failed reads from the tier.", ("read_errors",)),
    (_C, "lmcache_tier_stores", "Chunks written into the tier.", ("stores",)),
    (_C, "lmcache_tier_skipped_puts", "New chunks the tier's policy did not admit (answered SKIPPED).",
     ("skipped",)),
    (_G, "lmcache_tier_head_rule",
     "1 while cache_policy adaptive admits only the first chunk of first-seen prompts.", ("head_rule",)),
    (_C, "lmcache_tier_head_rule_switches", "Times cache_policy adaptive turned its head rule on or off.",
     ("head_rule_switches",)),
    (_G, "lmcache_tier_recency_order",
     "1 while cache_policy adaptive evicts least recently used first (else in lfuda's order).", ("recency_order",)),
    (_C, "lmcache_tier_recency_order_switches", "Times cache_policy adaptive turned its recency order on or off.",
     ("recency_order_switches",)),
    (_C, "lmcache_tier_admitted", "Chunks the tier's admission (disk_admission, remote_admission) let in.",
     ("admitted",)),
    (_C, "lmcache_tier_admission_declined", "Chunks not written to the tier: its admission did not take them.",
     ("declined",)),
    (_C, "lmcache_tier_admission_declined_bytes", "Payload bytes not written to the tier because of its admission.",
     ("declined_bytes",)),
    (_G, "lmcache_tier_degraded", "1 while the tier cannot be written.", ("degraded",)),
    (_G, "lmcache_tier_up", "1 while a remote tier (Redis uplink) is connected.", ("up",)),
    (_C, "lmcache_tier_dropped_writes", "Writes to a remote tier dropped (queue full or uplink down).",
     ("dropped_writes",)),
    (_G, "lmcache_tier_queued_writes", "Chunks waiting in the tier's write-behind queue.",
     ("queued_writes", "queued_spills")),
    (_C, "lmcache_tier_reconnects", "Times a remote tier reconnected.", ("reconnects",)),
    (_G, "lmcache_tier_queued_bytes", "Bytes waiting in the tier's write-behind queue.", ("queued_bytes",)),
    (_G, "lmcache_tier_chunks", "Chunks stored in the tier.", ("chunks",)),
    (_G, "lmcache_tier_stored_bytes", "Payload bytes stored in the tier.", ("stored_bytes",)),
    (_G, "lmcache_tier_capacity_bytes", "Capacity of the tier.", ("capacity_bytes",)),
    (_G, "lmcache_tier_used_bytes",
     "Bytes counted against capacity_bytes (allocator extents in memory, 4 KiB blocks on disk).",
     ("allocated_bytes", "disk_bytes")),
    (_G, "lmcache_tier_pinned_bytes", "Bytes pinned chunks hold in the tier (memory: extents, 4 KiB pages).",
     ("pinned_bytes",)),
    (_G, "lmcache_tier_fragmentation_ratio", "1 - largest free extent / free bytes of the tier's allocator.",
     ("fragmentation",)),
]  # fmt: skip


class StoreCollector(Collector):
    """Exports the store's own counters at scrape time."""

    def __init__(self, store: TieredStore, inflight_bytes: Callable[[], int], chunk_size: int):
        self.store = store
        self.inflight_bytes = inflight_bytes
        self.chunk_size = chunk_size

    def collect(self) -> Iterator[Any]:
        stats = self.store.stats()
        tiers = stats["tiers"]

        for kind, name, doc, fields in _TIER_FAMILIES:
            # One sample per tier, from the first of ``fields`` its stats have.
            metric = kind(name, doc, labels=["tier"])
            for tier, values in tiers.items():
                field = next((f for f in fields if f in values), None)
                if field is not None:
                    metric.add_metric([tier], float(values[field]))
            yield metric
        yield from _tenant_families(tiers)
        yield from _remote_op_families(tiers)
        yield CounterMetricFamily(
            "lmcache_lookup_chunks", "Chunks asked about by lookups.", value=stats["lookup_chunks"]
        )
        yield CounterMetricFamily(
            "lmcache_lookup_hit_chunks", "Leading chunks lookups found cached.", value=stats["lookup_hit_chunks"]
        )
        yield CounterMetricFamily(
            "lmcache_lookup_hit_tokens",
            "Tokens lookups found cached (chunks x chunk_size).",
            value=stats["lookup_hit_chunks"] * self.chunk_size,
        )
        yield GaugeMetricFamily(
            "lmcache_inflight_bytes", "Payload bytes being handled or sent now.", value=self.inflight_bytes()
        )


def _remote_op_families(tiers: dict[str, dict[str, Any]]) -> Iterator[Any]:
    """Requests to the remote tier's store by operation: how many, and the seconds they took."""
    calls = CounterMetricFamily(
        "lmcache_tier_ops", "Requests to a remote tier's store, by operation (failed ones included).",
        labels=["tier", "op"],
    )  # fmt: skip
    seconds = CounterMetricFamily(
        "lmcache_tier_op_seconds", "Seconds spent in requests to a remote tier's store, by operation.",
        labels=["tier", "op"],
    )  # fmt: skip
    for tier, values in tiers.items():
        for op, n in values.get("op_calls", {}).items():
            calls.add_metric([tier, op], float(n))
            seconds.add_metric([tier, op], float(values["op_seconds"].get(op, 0.0)))
    yield calls
    yield seconds


def _tenant_families(tiers: dict[str, dict[str, Any]]) -> Iterator[Any]:
    """Per-tenant quota use by tier (only tenants named in ``tenant_quotas``)."""
    used = GaugeMetricFamily(
        "lmcache_tenant_used_bytes",
        "Bytes a tenant holds in the tier (memory: extents in the pool, 4 KiB pages).",
        labels=["tier", "tenant"],
    )
    limit = GaugeMetricFamily(
        "lmcache_tenant_quota_bytes", "The tenant's quota in the tier (tenant_quotas).", labels=["tier", "tenant"]
    )
    evicted = CounterMetricFamily(
        "lmcache_tenant_quota_evictions",
        "Chunks of a tenant evicted to keep it within its quota.",
        labels=["tier", "tenant"],
    )
    for tier, values in tiers.items():
        for tenant, q in values.get("tenants", {}).items():
            used.add_metric([tier, tenant], float(q["used_bytes"]))
            limit.add_metric([tier, tenant], float(q["limit_bytes"]))
            evicted.add_metric([tier, tenant], float(q["quota_evictions"]))
    yield used
    yield limit
    yield evicted


def counter_value(counter: Counter) -> float:
    """The sum of a counter's ``_total`` samples over all its label sets."""
    return sum(
        sample.value for metric in counter.collect() for sample in metric.samples if sample.name.endswith("_total")
    )
