"""Metrics and the summary log line, scraped from the real daemon's /metrics and read from its log.

Also home of the helpers the deploy tests share: :func:`scrape` (the text of
/metrics), :func:`exported_names` (every series name a daemon exports, from
its ``# TYPE`` lines) and :func:`metric_names` (the metric names a PromQL
expression refers to).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import urllib.request
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import zmq

from lmcache_client import PutStatus
from lmcache_client.protocol import KEY_BYTES
from lmcache_server.config import ConfigError, load_config
from lmcache_server.summary import Snapshot, SummaryLog, summary_line

from ..conftest import NAMESPACE, Daemon, RedisServer, wait_for

MiB = 1 << 20

# Every family the issue asks for, by the name Prometheus sees (counters with _total).
EXPECTED = {
    # requests by op and outcome (errors by code), latency by op, bytes in/out, BUSY
    "lmcache_requests_total", "lmcache_request_duration_seconds_bucket", "lmcache_request_duration_seconds_count",
    "lmcache_received_payload_bytes_total", "lmcache_sent_payload_bytes_total", "lmcache_busy_rejections_total",
    "lmcache_inflight_bytes",
    # per tier: hits, misses, chunks and bytes stored, capacity, evictions, promotions, spills
    "lmcache_tier_hits_total", "lmcache_tier_misses_total", "lmcache_tier_chunks", "lmcache_tier_stored_bytes",
    "lmcache_tier_used_bytes", "lmcache_tier_capacity_bytes", "lmcache_tier_evictions_total",
    "lmcache_tier_evicted_bytes_total", "lmcache_tier_promotions_total", "lmcache_tier_spills_total",
    "lmcache_tier_spills_dropped_total", "lmcache_tier_stores_total", "lmcache_tier_degraded",
    # lookups (the lookup hit rate), uplink state, queue depth, dropped writes
    "lmcache_lookup_chunks_total", "lmcache_lookup_hit_chunks_total", "lmcache_lookup_hit_tokens_total",
    "lmcache_tier_up", "lmcache_tier_queued_writes", "lmcache_tier_queued_bytes", "lmcache_tier_dropped_writes_total",
    "lmcache_tier_reconnects_total", "lmcache_tier_write_errors_total", "lmcache_tier_read_errors_total",
    # connected clients, build, process
    "lmcache_connected_clients", "lmcache_client_connections_total", "lmcache_client_disconnections_total",
    "lmcache_build_info", "process_resident_memory_bytes", "process_start_time_seconds", "process_cpu_seconds_total",
    # the shared-memory path (present while the pool is shared, the default)
    "lmcache_shm_enabled", "lmcache_shm_leases", "lmcache_shm_leases_granted_total", "lmcache_shm_leases_expired_total",
    "lmcache_shm_leased_bytes", "lmcache_shm_bytes_total",
}  # fmt: skip


# -- helpers shared with test_deploy / test_prometheus ----------------------------------
def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}


def exported_names(text: str) -> set[str]:
    """Series names of every family in an exposition, with or without samples yet."""
    names: set[str] = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M):
        base = name.removesuffix("_total") if kind == "counter" else name
        names.update(base + suffix for suffix in _SUFFIXES.get(kind, ("",)))
    return names


_PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
    "inf", "nan",
}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (not functions, labels, keywords or variables)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)  # label lists
    expr = re.sub(r"\$\{?\w+\}?", "", expr)  # Grafana variables
    names = set()
    for match in re.finditer(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", expr):
        name, call = match.groups()
        if not call and name.lower() not in _PROMQL_WORDS:
            names.add(name)
    return names


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in an exposition, None when absent."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head == name and not labels:
            return float(value)
        if head.startswith(name + "{"):
            found = dict(re.findall(r'(\w+)="([^"]*)"', head[len(name) :]))
            if found == labels:
                return float(value)
    return None


def test_metric_names_parses_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (op, le) (rate(lmcache_request_duration_seconds_bucket{instance=~"$x"}'
        "[$__rate_interval]))) / on (job) group_left () instance:lmcache_chunk_reads:rate5m > 1 and up offset 5m"
    )
    assert metric_names(expr) == {
        "lmcache_request_duration_seconds_bucket",
        "instance:lmcache_chunk_reads:rate5m",
        "up",
    }
    assert metric_names('absent(up{lmcache_role="server"})') == {"up"}
    assert metric_names('time() - process_start_time_seconds{a="b"}') == {"process_start_time_seconds"}


# -- the daemon's families ---------------------------------------------------------------
def test_every_family_is_exported(
    daemon_factory: Callable[..., Daemon], redis_server: RedisServer, tmp_path: Path
) -> None:
    daemon = daemon_factory(
        local_disk=f"file://{tmp_path}/spill", max_local_disk_size="64MiB", remote_url=redis_server.url
    )
    text = scrape(daemon.metrics_port)
    missing = EXPECTED - exported_names(text)
    assert not missing, missing
    assert sample(text, "lmcache_build_info", version="0.1.0") == 1.0
    for tier in ("memory", "disk"):
        assert sample(text, "lmcache_tier_capacity_bytes", tier=tier) == 64 * MiB
    # The uplink families the alerts and the dashboard use, with a real Redis.
    wait_for(lambda: sample(scrape(daemon.metrics_port), "lmcache_tier_up", tier="redis") == 1.0)
    assert sample(text, "lmcache_tier_dropped_writes_total", tier="redis") == 0.0
    assert sample(text, "lmcache_tier_queued_writes", tier="redis") == 0.0
    assert sample(text, "lmcache_tier_queued_writes", tier="disk") == 0.0  # the spill queue
    assert (sample(text, "process_resident_memory_bytes") or 0) > 10 * MiB


# Gauges whose value is a fraction (0..1): Prometheus names them ``*_ratio``.
RATIO_GAUGES = {
    "lmcache_hit_rate_ceiling_ratio", "lmcache_hit_rate_window_ratio", "lmcache_hit_rate_sketch_error_ratio",
    "lmcache_tier_fragmentation_ratio",
}  # fmt: skip
# Words that, at the end of a gauge's name, say its value is a fraction.
_FRACTION_WORDS = ("_rate", "_ceiling", "_window", "_error", "_fragmentation", "_fraction", "_share", "_usage")


def test_ratio_gauges_end_in_ratio(daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    daemon = daemon_factory(local_disk=f"file://{tmp_path}/spill", max_local_disk_size="64MiB")
    text = scrape(daemon.metrics_port)
    gauges = set(re.findall(r"^# TYPE (\S+) gauge$", text, flags=re.M))
    assert gauges >= RATIO_GAUGES, RATIO_GAUGES - gauges
    misnamed = {name for name in gauges if name.endswith(_FRACTION_WORDS)}
    assert not misnamed, f"fractions not named *_ratio: {misnamed}"
    assert sample(text, "lmcache_tier_fragmentation_ratio", tier="memory") == 0.0  # an empty pool: one extent


def test_connected_clients_follow_connections(daemon: Daemon) -> None:
    def clients() -> float | None:
        return sample(scrape(daemon.metrics_port), "lmcache_connected_clients")

    wait_for(lambda: clients() == 0.0)  # the fixture's start-up probe has left
    accepted = sample(scrape(daemon.metrics_port), "lmcache_client_connections_total") or 0.0
    tcp = daemon.client()
    ipc = daemon.client(address=daemon.ipc_address)
    try:
        tcp.ping()
        ipc.ping()
        wait_for(lambda: clients() == 2.0)
        tcp.close()
        wait_for(lambda: clients() == 1.0)
    finally:
        tcp.close()
        ipc.close()
    wait_for(lambda: clients() == 0.0)
    text = scrape(daemon.metrics_port)
    assert sample(text, "lmcache_client_connections_total") == accepted + 2
    assert sample(text, "lmcache_client_disconnections_total") == accepted + 2


def test_errors_are_counted_by_code(daemon: Daemon) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.address)
    try:
        bad_key = {"v": 1, "op": "get", "id": 1, "ns": NAMESPACE, "keys": [b"k" * (KEY_BYTES - 1)]}
        unknown_op = {"v": 1, "op": "frobnicate", "id": 2}
        for header in (b"\xc1", msgpack.packb(bad_key), msgpack.packb(unknown_op)):
            sock.send(header)
            assert sock.poll(5000), "no reply"
            sock.recv_multipart()
    finally:
        sock.close()
        ctx.term()
    with daemon.client() as c:
        c.get([os.urandom(KEY_BYTES)])
    text = scrape(daemon.metrics_port)
    assert sample(text, "lmcache_requests_total", op="invalid", outcome="MALFORMED") == 1.0
    assert sample(text, "lmcache_requests_total", op="invalid", outcome="BAD_KEY") == 1.0
    assert sample(text, "lmcache_requests_total", op="invalid", outcome="UNKNOWN_OP") == 1.0
    assert sample(text, "lmcache_requests_total", op="get", outcome="ok") == 1.0


def test_tier_counters_track_eviction_spill_and_promotion(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = daemon_factory(
        max_local_cpu_size="8MiB", local_disk=f"file://{tmp_path}/spill", max_local_disk_size="64MiB"
    )
    keys = [os.urandom(KEY_BYTES) for _ in range(16)]
    data = [os.urandom(MiB) for _ in keys]
    # Payload frames: the socket byte counters below count them (shared-memory bytes are counted apart).
    with daemon.client(shared_memory=False) as c:
        for k, d in zip(keys, data):
            assert c.put([k], [d]) == [PutStatus.STORED]
        wait_for(lambda: c.stats()["tiers"]["disk"]["spills"] >= 8)
        assert c.lookup(keys[:1]).tiers == ["disk"]
        assert bytes(c.get(keys[:1])[0]) == data[0]  # a disk hit, promoted
    text = scrape(daemon.metrics_port)
    assert sample(text, "lmcache_tier_stores_total", tier="memory") == 17.0  # 16 puts + 1 promotion
    assert (sample(text, "lmcache_tier_evictions_total", tier="memory") or 0) >= 8
    assert (sample(text, "lmcache_tier_spills_total", tier="disk") or 0) >= 8
    assert sample(text, "lmcache_tier_hits_total", tier="disk") == 1.0
    assert sample(text, "lmcache_tier_promotions_total", tier="disk") == 1.0
    assert sample(text, "lmcache_tier_misses_total", tier="memory") == 1.0
    used = sample(text, "lmcache_tier_used_bytes", tier="disk") or 0
    stored = sample(text, "lmcache_tier_stored_bytes", tier="disk") or 0
    assert used >= stored >= 8 * MiB  # blocks on disk include the headers
    assert 8 * MiB >= (sample(text, "lmcache_tier_used_bytes", tier="memory") or 0) >= 7 * MiB
    assert sample(text, "lmcache_received_payload_bytes_total") == 16 * MiB
    assert sample(text, "lmcache_sent_payload_bytes_total") == MiB


# -- the summary line ---------------------------------------------------------------------
def test_summary_line_is_logged_periodically(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory(stats_log_interval_s=0.2, chunk_size=16)
    keys = [os.urandom(KEY_BYTES) for _ in range(4)]
    with daemon.client() as c:
        c.put(keys[:2], [b"x" * 1000] * 2)
        c.get(keys)  # 2 of 4 chunks hit memory
        c.lookup(keys)
        # The get and the lookup may land in two intervals: find each one's line.
        get = wait_for(lambda: next((ln for ln in daemon.log().splitlines() if "get hit" in ln), None))
        lookup = wait_for(lambda: next((ln for ln in daemon.log().splitlines() if "lookup hit" in ln), None))
    assert "INFO lmcache_server.summary: summary (last " in get
    assert "get hit 50.0% of 64 tokens reused (memory 32); " in get
    assert "lookup hit 50.0% of 64 tokens; " in lookup
    assert re.search(r"; memory \d+\.\d% of 64 MiB, 0 evictions; 1 client$", get), get
    # Idle intervals still log (a heartbeat operators can rely on).
    wait_for(lambda: "no chunk reads; no lookups; 0.0 req/s" in daemon.log())


def test_summary_line_format() -> None:
    prev = Snapshot(
        at=100.0, reads=10, hits={"memory": 5, "disk": 0, "redis": 0}, lookup_chunks=0, lookup_hit_chunks=0,
        requests=50, received_bytes=0, sent_bytes=0, evictions=3, memory_used_bytes=0,
        memory_capacity_bytes=5 << 30, uplink_up=True, dropped_writes=1, clients=2,
    )  # fmt: skip
    cur = Snapshot(
        at=130.0, reads=50, hits={"memory": 33, "disk": 6, "redis": 1}, lookup_chunks=80, lookup_hit_chunks=60,
        requests=110, received_bytes=30 * MiB, sent_bytes=60 * MiB, evictions=15, memory_used_bytes=4 << 30,
        memory_capacity_bytes=5 << 30, uplink_up=False, dropped_writes=5, clients=3,
    )  # fmt: skip
    assert summary_line(prev, cur, 256) == (
        "summary (last 30s): get hit 87.5% of 10240 tokens reused (memory 7168, disk 1536, redis 256); "
        "lookup hit 75.0% of 20480 tokens; 2.0 req/s, in 1.00 MiB/s, out 2.00 MiB/s; "
        "memory 80.0% of 5.00 GiB, 12 evictions; redis DOWN, 4 dropped writes; 3 clients"
    )
    mooncake = dataclasses.replace(cur, uplink="mooncake", uplink_up=True)
    assert "; mooncake up, 4 dropped writes; " in summary_line(prev, mooncake, 256)


def test_summary_interval_zero_starts_no_task() -> None:
    async def run() -> None:
        log = SummaryLog(None, None, lambda: 0, 256, 0.0)  # type: ignore[arg-type]
        log.start()
        assert log._task is None
        await log.close()

    asyncio.run(run())


@pytest.mark.parametrize("value", [-1, "often", 86401, True])
def test_summary_interval_is_validated(value: object) -> None:
    with pytest.raises(ConfigError, match="stats_log_interval_s"):
        load_config(environ={}, overrides={"stats_log_interval_s": value})
    assert load_config(environ={}, overrides={"stats_log_interval_s": 0}).stats_log_interval_s == 0.0
    assert load_config(environ={}).stats_log_interval_s == 30.0
