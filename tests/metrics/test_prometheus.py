"""A real Prometheus server scrapes a real daemon with the shipped scrape job and rules.

The daemon runs with memory, disk and Redis tiers; Prometheus (the Debian
``prometheus`` binary, required: ``make test`` installs it) scrapes it every
second on loopback with the ``lmcache-server`` job of
deploy/prometheus/prometheus.yml, renamed ``kv-cache`` (the rules must not
depend on the job name), and evaluates deploy/prometheus/rules.yml.
The test then asks Prometheus's HTTP API for the daemon's metrics, the
recorded hit rates (against the hits and misses it caused) and the health of
every rule.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest
import yaml

from lmcache_client.protocol import KEY_BYTES

from ..conftest import Daemon, RedisServer, free_port
from .test_metrics import wait_for

REPO = Path(__file__).resolve().parents[2]
# Labels every series of the daemon's target gets (lmcache_role: prometheus.yml's target label).
TARGET_LABELS = ("__name__", "job", "instance", "lmcache_role")


class Prometheus:
    def __init__(self, workdir: Path, targets: list[str]):
        binary = shutil.which("prometheus")
        if binary is None:  # fail loudly: make test installs it (scripts/system-deps.sh)
            pytest.fail("prometheus is not installed; run `make system-deps` (Debian: apt-get install prometheus)")
        shipped = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
        job = next(j for j in shipped["scrape_configs"] if j["job_name"] == "lmcache-server")
        job["job_name"] = "kv-cache"  # whatever a platform calls it
        job["static_configs"][0]["targets"] = targets  # keeps the shipped target labels
        job["scrape_interval"] = "1s"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(REPO / "deploy" / "prometheus" / "rules.yml")],
            "scrape_configs": [job],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "prometheus.log"
        self.argv = [
            binary,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Prometheus:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, f"prometheus exited:\n{self.log.read_text()}"
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            assert time.monotonic() < deadline, f"prometheus not ready:\n{self.log.read_text()}"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> dict[str, float]:
        """Instant query -> {"label=value,...": value} (without __name__ and the target's labels)."""
        out = {}
        for series in self.api("query", query=expr)["result"]:
            labels = {k: v for k, v in series["metric"].items() if k not in TARGET_LABELS}
            out[",".join(f"{k}={v}" for k, v in sorted(labels.items()))] = float(series["value"][1])
        return out


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[Callable[[list[str]], Prometheus]]:
    started: list[Prometheus] = []

    def start(targets: list[str]) -> Prometheus:
        workdir = tmp_path / f"prometheus{len(started)}"
        workdir.mkdir()
        server = Prometheus(workdir, targets)
        started.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in started:
            server.stop()


def test_prometheus_scrapes_the_daemon_and_records_hit_rates(
    daemon_factory: Callable[..., Daemon],
    redis_server: RedisServer,
    prometheus_factory: Callable[[list[str]], Prometheus],
    tmp_path: Path,
) -> None:
    daemon = daemon_factory(
        local_disk=f"file://{tmp_path}/spill", max_local_disk_size="64MiB", remote_url=redis_server.url
    )
    target = f"127.0.0.1:{daemon.metrics_port}"
    prom = prometheus_factory([target])
    # The first scrape sees every counter at 0, so rates cover exactly what follows.
    wait_for(lambda: prom.query('up{lmcache_role="server"}') == {"": 1.0})
    wait_for(lambda: prom.query('lmcache_tier_hits_total{tier="memory"}') == {"tier=memory": 0.0})

    stored = [os.urandom(KEY_BYTES) for _ in range(4)]
    unknown = [os.urandom(KEY_BYTES) for _ in range(4)]
    with daemon.client(shared_memory=False) as c:  # one put request (shared memory: alloc + commit)
        c.put(stored, [os.urandom(64 * 1024) for _ in stored])
        assert sum(g is not None for g in c.get(stored + unknown)) == 4  # 4 memory hits, 4 misses everywhere
        assert c.lookup(stored + unknown).hit_chunks == 4

        def recorded() -> dict[str, float] | None:
            rates = prom.query("instance:lmcache_chunk_hits:ratio_rate5m")
            return rates if math.isclose(rates.get("", math.nan), 0.5) else None

        wait_for(recorded, timeout_s=30)
    rates = prom.query("instance_tier:lmcache_chunk_hits:ratio_rate5m")
    assert rates == {"tier=memory": 0.5, "tier=disk": 0.0, "tier=redis": 0.0}
    wait_for(lambda: prom.query("instance:lmcache_lookup_hit_chunks:ratio_rate5m") == {"": 0.5})

    # The daemon's families, as Prometheus stored them.  A recording rule over
    # rate() stores its first sample only once a series has two scrapes in its
    # window, which can be an evaluation after the hit rates: wait for them all.
    expected = {"lmcache_requests_total", "lmcache_request_duration_seconds_bucket", "lmcache_tier_hits_total",
                "lmcache_tier_capacity_bytes", "lmcache_tier_used_bytes", "lmcache_connected_clients",
                "lmcache_tier_up", "lmcache_lookup_hit_tokens_total", "process_resident_memory_bytes",
                "instance_op:lmcache_request_duration_seconds:p99",
                "instance_tier:lmcache_tier_used_bytes:ratio"}  # fmt: skip
    try:
        wait_for(lambda: expected <= set(prom.api("label/__name__/values")), timeout_s=30)
    except AssertionError:
        pass  # the assertion below names what is missing
    names = set(prom.api("label/__name__/values"))
    for name in sorted(expected):
        assert name in names, name
    assert prom.query('lmcache_tier_up{tier="redis"}') == {"tier=redis": 1.0}
    assert prom.query('lmcache_requests_total{op="put"}') == {"op=put,outcome=ok": 1.0}
    assert prom.query("lmcache_tier_capacity_bytes") == {"tier=disk": 64 * 2**20, "tier=memory": 64 * 2**20}
    series = prom.api("series", **{"match[]": "lmcache_tier_hits_total"})
    assert {s["instance"] for s in series} == {target} and {s["job"] for s in series} == {"kv-cache"}

    # Every recording rule and alert evaluates without error on live data, and none fires.
    groups = prom.api("rules")["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) == sum(
        len(g["rules"]) for g in yaml.safe_load((REPO / "deploy/prometheus/rules.yml").read_text())["groups"]
    )
    assert [r["name"] for r in rules if r["health"] != "ok"] == []
    assert prom.api("alerts")["alerts"] == []

    # Every dashboard query is valid PromQL, and all but the error panel find series here.
    dashboard = json.loads((REPO / "deploy" / "grafana" / "lmcache.json").read_text())
    empty = []
    variables = {"$__rate_interval": "1m", "$__range": "5m", "$instance": target}
    for panel in dashboard["panels"]:
        for query in panel.get("targets", []):
            expr = query["expr"]
            for name, value in variables.items():
                expr = expr.replace(name, value)
            if not prom.api("query", query=expr)["result"]:
                empty.append(panel["title"])
    # No request failed; no vLLM replica is scraped here (tests/integrations/vllm/test_vllm_server.py
    # reads the prompt token sources from a real replica's /metrics).
    assert empty == ["Where prompt tokens came from", "Errors by code"]

    # docs/operations.md's picture of the dashboard is drawn by deploy/grafana/preview.py from the
    # same queries: it draws every panel, a line for each series found, "No data" for the rest.
    spec = importlib.util.spec_from_file_location("preview", REPO / "deploy" / "grafana" / "preview.py")
    assert spec and spec.loader
    preview = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(preview)
    end = time.time()
    svg = ElementTree.fromstring(preview.render(prom.url, end - 60, end, rate_s=5))
    texts = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert {p["title"] for p in dashboard["panels"]} <= set(texts)
    assert texts.count("No data") == 2  # Errors by code, Where prompt tokens came from
    assert len(list(svg.iter("{http://www.w3.org/2000/svg}polyline"))) >= 20
