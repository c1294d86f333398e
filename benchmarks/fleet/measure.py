"""One configuration measured: its stack started, the workload replayed, the counters read.

:func:`run_configuration` returns a :class:`ConfigResult`: every request's outcome, the
run's wall time, and the deltas over the replay (a warm-up request per replica comes
before the first reading) of

- vLLM's own ``vllm:prompt_tokens_by_source_total{source=local_compute|local_cache_hit|
  external_kv_transfer}`` summed over the replicas (every configuration has it; the
  three sum to the prompt tokens vLLM admitted);
- our connector's ``vllm:lmcache_server_prompt_tokens_total{source=recomputed|vllm_cache|
  memory|disk|redis}`` (``lmcache-server`` only);
- vLLM's ``vllm:num_preemptions_total`` summed over the replicas;
- the cache service's CPU seconds (``/proc``, the process and its children) and, for our
  daemon, its ``lmcache_sent_payload_bytes_total`` / ``lmcache_received_payload_bytes_total``.
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import Any

from .replay import Outcome, Replayer
from .routers import make_router
from .stack import FleetSettings, Stack, model_name, start_stack, warm_up
from .trace import Workload, block_tokens

VLLM_SOURCES = "vllm:prompt_tokens_by_source_total"
CONNECTOR_SOURCES = "vllm:lmcache_server_prompt_tokens_total"
PREEMPTIONS = "vllm:num_preemptions_total"
DAEMON_BYTES = {"sent": "lmcache_sent_payload_bytes_total", "received": "lmcache_received_payload_bytes_total"}
WARMUP_HASH = -1  # no trace block has a negative id: the warm-up prompt shares nothing with the workload


@dataclasses.dataclass
class ConfigResult:
    name: str
    replicas: int
    router: str
    outcomes: list[Outcome] = dataclasses.field(default_factory=list)
    wall_s: float = 0.0
    vllm_sources: dict[str, float] = dataclasses.field(default_factory=dict)
    per_replica_sources: list[dict[str, float]] = dataclasses.field(default_factory=list)
    connector_sources: dict[str, float] = dataclasses.field(default_factory=dict)
    preemptions: float = 0.0
    """vLLM's preemptions over the replay, every replica (a request pushed out of the KV
    cache to make room recomputes what it had)."""
    service_cpu_s: float | None = None
    service_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
    serial_texts: list[str] = dataclasses.field(default_factory=list)
    """With ``serial_check``: each request's output sent alone after the replay (same replica)."""
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _by_source(metrics: dict[tuple[str, str], float], name: str) -> dict[str, float]:
    return {source: v for (n, source), v in metrics.items() if n == name and source}


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def _sum(dicts: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


def measure(stack: Stack, workload: Workload, router: str, serial_check: bool = False) -> ConfigResult:
    """Replay ``workload`` on a started stack; the result with the counters' deltas (and,
    with ``serial_check``, every request sent again alone after the counters were read)."""
    result = ConfigResult(stack.configuration.name, len(stack.replicas), router)
    warm_up(stack, block_tokens(WARMUP_HASH, 64))
    before = stack.replica_metrics()
    service = stack.service
    service_before = service.metrics() if service else {}
    cpu_before = service.cpu_seconds() if service else 0.0
    replayer = Replayer(stack.urls, model_name(stack.settings), make_router(router))
    result.outcomes, result.wall_s = replayer.run(workload.requests)
    time.sleep(1.0)  # vLLM records a finished request's stats after streaming its last token
    stack.check_alive()
    after = stack.replica_metrics()
    result.per_replica_sources = [
        _delta(_by_source(a, VLLM_SOURCES), _by_source(b, VLLM_SOURCES)) for a, b in zip(after, before)
    ]
    result.vllm_sources = _sum(result.per_replica_sources)
    result.preemptions = sum(
        a.get((PREEMPTIONS, ""), 0.0) - b.get((PREEMPTIONS, ""), 0.0) for a, b in zip(after, before)
    )
    result.connector_sources = _sum(
        [_delta(_by_source(a, CONNECTOR_SOURCES), _by_source(b, CONNECTOR_SOURCES)) for a, b in zip(after, before)]
    )
    if service is not None:
        result.service_cpu_s = service.cpu_seconds() - cpu_before
        service_after = service.metrics()
        for what, metric in DAEMON_BYTES.items():
            if (metric, "") in service_after:
                result.service_bytes[what] = service_after[(metric, "")] - service_before.get((metric, ""), 0.0)
    if serial_check:
        serial = replayer.run_serial(workload.requests, [o.replica for o in result.outcomes])
        result.serial_texts = [o.text if o.ok else f"error: {o.error}" for o in serial]
    return result


def run_configuration(
    name: str, settings: FleetSettings, workload: Workload, router: str, workdir: Path, serial_check: bool = False
) -> ConfigResult:
    """Start configuration ``name`` fresh, replay, stop it; a configuration that cannot run
    here comes back with its ``error`` (the exception and the tail of its logs)."""
    try:
        with start_stack(name, settings, workdir / f"{name}-{router}-{settings.replicas}") as stack:
            return measure(stack, workload, router, serial_check)
    except Exception as err:  # reported per configuration; the others still run
        return ConfigResult(name, settings.replicas, router, error=root_cause(f"{type(err).__name__}: {err}"))


def root_cause(message: str) -> str:
    """A failed start's message cut to its first line and the log's exception lines (vLLM's
    root cause sits above its generic "Engine core initialization failed")."""
    lines = message.splitlines()
    causes = [line.strip() for line in lines[1:] if re.search(r"\w*(Error|Exception): ", line)]
    return "\n".join([lines[0][:300], *dict.fromkeys(causes)]) if lines else message
