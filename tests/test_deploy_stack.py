"""The CPU compose stack for real (issue 28): images built with podman, the stack of
docker-compose.yml + deploy/compose.cpu.yml started with podman-compose, checked end to end.

The module builds the local Debian base once per machine (scripts/local-base.sh, reused when
present), our images (podman's layer cache keeps a rebuild short), a tiny model with the vLLM
harness, then starts the daemon, Redis, two vLLM CPU replicas and Prometheus.  The checks go
over HTTP to the containers' addresses on the stack's network: on this machine a
connection to a published port on 127.0.0.1 is answered by the sandbox, not by the container
(docs/deploy.md, "What was run").  podman, runc, debootstrap and the dnsname CNI plugin come
from scripts/system-deps.sh; a missing one fails the module instead of skipping it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
PROJECT = "lmcache-cpu"
DAEMON = "lmcache-cpu-server"  # container_name in deploy/compose.cpu.yml
BASE = os.environ.get("LMCACHE_LOCAL_BASE", "localhost/debian-py311:bookworm")
TOOLS = "localhost/lmcache-cpu-tools:latest"
VLLM_VENV = REPO / os.environ.get("VLLM_VENV", ".venv-vllm")
LOCK = "/tmp/heavy.lock"  # image builds and stack starts share the machine's cores
ULIMITS = ["--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]
PROMPT_WORDS = 1100  # four 256-token chunks and a tail

pytestmark = pytest.mark.timeout(1500)


def program(name: str) -> str:
    path = shutil.which(name) or (str(REPO / ".venv" / "bin" / name) if (REPO / ".venv/bin" / name).exists() else None)
    if path is None:
        pytest.fail(f"{name} is not installed; run `make system-deps` (podman, runc, debootstrap) or `make setup-test`")
    return path


def sh(*args: str, timeout: float = 900, check: bool = True, env: dict[str, str] | None = None) -> str:
    """Run a command; its output, or a failure that shows the output's tail."""
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    if check and out.returncode != 0:
        pytest.fail(f"{' '.join(args[:6])} ... exited {out.returncode}:\n{(out.stdout + out.stderr)[-3000:]}")
    return out.stdout


def heavy(*args: str, timeout: float = 900, env: dict[str, str] | None = None) -> str:
    return sh("flock", LOCK, *args, timeout=timeout, env=env)


BUILT_HERE = "io.lmcache.built-by=tests/test_deploy_stack.py"
"""The label on every image this test builds (what its prune may remove)."""


def find_links() -> list[str]:
    """pip's find-links folders: PIP_FIND_LINKS, else pip's configuration."""
    if os.environ.get("PIP_FIND_LINKS"):
        return os.environ["PIP_FIND_LINKS"].split()
    config = sh(sys.executable, "-m", "pip", "config", "list", check=False)
    return [
        v.strip("'\"") for k, _, v in (line.partition("=") for line in config.splitlines()) if k.endswith("find-links")
    ]


def build_images() -> None:
    """Our three images, from the local base (podman's layer cache: a rebuild is seconds)."""
    podman = program("podman")
    build = [podman, "--runtime", "runc", "build", *ULIMITS, "--label", BUILT_HERE, "--build-arg"]
    heavy(*build, f"PYTHON_IMAGE={BASE}", "-f", "deploy/Dockerfile", "-t", "localhost/lmcache-server:latest", ".")
    heavy(*build, f"BASE_IMAGE={BASE}", "-f", "deploy/cpu-tools.Dockerfile", "-t", TOOLS, ".")
    # torch's CPU wheel: PyTorch's index by default; a machine without it lists a folder
    # holding the wheel in PIP_FIND_LINKS (this one does), mounted into the build.
    wheels = [p for p in find_links() if Path(p).is_dir()]
    extra = ["-v", f"{wheels[0]}:/wheels:ro", "--build-arg", "PIP_FIND_LINKS=/wheels"] if wheels else []
    extra += ["--build-arg", "PIP_EXTRA_INDEX_URL="] if wheels else []
    heavy(
        *build,
        f"BASE_IMAGE={BASE}",
        *extra,
        "-f",
        "deploy/vllm-cpu.Dockerfile",
        "-t",
        "localhost/lmcache-vllm-cpu:latest",
        ".",
    )
    # A rebuild after a source change leaves the previous image untagged: drop those
    # (only images these builds made: the machine's other untagged images stay).
    sh(podman, "image", "prune", "-f", "--filter", f"label={BUILT_HERE}")


def tiny_model(root: Path) -> Path:
    """The vLLM tests' llama checkpoint (random weights, word-level tokenizer), readable by the containers."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{python} is missing: run `make setup-vllm`")
    sh(str(python), "-m", "tests.integrations.vllm.vllm_harness.models", str(root), "llama", timeout=300)
    model = root / "llama"
    for path in [root, model, *model.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return model


class Stack:
    """podman-compose on docker-compose.yml + deploy/compose.cpu.yml, and the containers' addresses."""

    def __init__(self, model: Path) -> None:
        self.env = {
            **os.environ,
            "MODEL_DIR": str(model),
            "BASE_IMAGE": BASE,
            "REDIS_IMAGE": TOOLS,
            "PROMETHEUS_IMAGE": TOOLS,
        }
        compose = program("podman-compose")
        self.compose = [compose, "--in-pod", "false", "--podman-args=--runtime runc", "-p", PROJECT]
        self.compose += ["-f", "docker-compose.yml", "-f", "deploy/compose.cpu.yml"]

    def run(self, *args: str, timeout: float = 300) -> str:
        """podman-compose ARGS; `up` waits for the machine's heavy-run lock."""
        command = [*self.compose, *args]
        return (
            heavy(*command, timeout=timeout, env=self.env)
            if "up" in args
            else sh(*command, timeout=timeout, env=self.env)
        )

    def container(self, service: str) -> str:
        return DAEMON if service == "lmcache-server" else f"{PROJECT}_{service}_1"

    def address(self, service: str) -> str:
        """The container's IP on the stack's network (compose.cpu.yml puts every service on one)."""
        nets = json.loads(
            sh("podman", "inspect", self.container(service), "--format", "{{json .NetworkSettings.Networks}}")
        )
        net = nets.get(f"{PROJECT}_default") or next(iter(nets.values()))
        return str(net["IPAddress"])

    def logs(self, service: str) -> str:
        out = subprocess.run(["podman", "logs", self.container(service)], capture_output=True, text=True, timeout=60)
        return out.stdout + out.stderr

    def daemon_metrics(self) -> str:
        """The daemon's /metrics (its port is not published: read inside its container)."""
        code = (
            "import urllib.request as r; print(r.urlopen('http://127.0.0.1:9464/metrics', timeout=5).read().decode())"
        )
        return sh("podman", "exec", DAEMON, "python", "-c", code, timeout=60)

    def leftovers(self) -> list[str]:
        """The containers, networks and volumes of the project still there (by label or by name)."""
        label = f"label=io.podman.compose.project={PROJECT}"
        found = set()
        for kind, fmt in (("container", "{{.Names}}"), ("network", "{{.Name}}"), ("volume", "{{.Name}}")):
            listing = ["podman", "ps", "-a"] if kind == "container" else ["podman", kind, "ls"]
            labelled = sh(*listing, "--filter", label, "--format", fmt).split()
            named = [n for n in sh(*listing, "--format", fmt).split() if n.startswith(PROJECT)]
            found |= {f"{kind} {n}" for n in labelled + named}
        return sorted(found)


def get(url: str, timeout: float = 10) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body = r.read().decode()
    return json.loads(body) if body[:1] in ("{", "[") else body


def complete(host: str, prompt: str) -> dict[str, Any]:
    data = json.dumps({"model": "model", "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(
        f"http://{host}:8000/v1/completions", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


def counter(text: str, name: str) -> float:
    """The sum of a metric family's samples in a Prometheus text page."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def until(check: Callable[[], Any], what: str, timeout_s: float = 600, every_s: float = 2) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (OSError, ValueError) as e:
            last = e
        time.sleep(every_s)
    pytest.fail(f"timed out waiting for {what} (last: {last!r})")


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(1000)}" for _ in range(n))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    for name in ("runc", "debootstrap"):
        program(name)
    heavy("bash", "scripts/local-base.sh", BASE, timeout=1800)
    build_images()
    s = Stack(tiny_model(tmp_path_factory.mktemp("models")))
    s.run("down", "-v")  # a stack left by an interrupted run
    try:
        s.run("up", "-d", "--no-build")
        for service in ("vllm-a", "vllm-b"):
            until(lambda service=service: get(f"http://{s.address(service)}:8000/health") == "", f"{service} /health")
        yield s
    finally:
        s.run("down", "-v")


def test_replica_b_is_served_from_replica_a_chunks(stack: Stack) -> None:
    a, b = stack.address("vllm-a"), stack.address("vllm-b")
    # A's connector may still be probing the daemon (it started with it): a new long prompt to
    # A until the daemon has stored one, then the same prompt to B.
    seed = iter(range(100, 200))

    def a_stored() -> str | None:
        prompt = words(PROMPT_WORDS, next(seed))
        complete(a, prompt)
        return prompt if counter(stack.daemon_metrics(), 'lmcache_requests_total{op="put",outcome="ok"}') > 0 else None

    prompt = until(a_stored, "replica A's first put", timeout_s=180, every_s=1)
    hits_before = counter(stack.daemon_metrics(), "lmcache_lookup_hit_chunks_total")
    out_b = complete(b, prompt)
    assert out_b["usage"]["prompt_tokens"] == PROMPT_WORDS
    vllm_b = get(f"http://{b}:8000/metrics")
    # vLLM's own counters: B's prompt came from the connector (external), not its own prefix cache.
    assert counter(vllm_b, "vllm:external_prefix_cache_hits_total") >= 4 * 256, vllm_b[-2000:]
    assert counter(vllm_b, "vllm:prefix_cache_hits_total") == 0
    # Ours: the daemon answered B's lookup with A's chunks.
    assert counter(stack.daemon_metrics(), "lmcache_lookup_hit_chunks_total") >= hits_before + 4
    # The same answer as A gave (greedy decoding from the same KV).
    assert complete(a, prompt)["choices"][0]["text"] == out_b["choices"][0]["text"]


def test_prometheus_scrapes_the_daemon_and_loads_our_rules(stack: Stack) -> None:
    prometheus = f"http://{stack.address('prometheus')}:9090"

    def daemon_up() -> list[dict[str, Any]]:
        targets = get(f"{prometheus}/api/v1/targets")["data"]["activeTargets"]
        return [t for t in targets if t["labels"]["job"] == "lmcache-server" and t["health"] == "up"]

    until(daemon_up, "Prometheus's lmcache-server target up", timeout_s=120)
    groups = {g["name"]: g for g in get(f"{prometheus}/api/v1/rules")["data"]["groups"]}
    assert {"lmcache-recording", "lmcache-alerts"} <= set(groups)
    alerts = {r["name"] for r in groups["lmcache-alerts"]["rules"]}
    assert {"LMCacheDaemonDown", "LMCacheLowHitRate"} <= alerts
    assert all(r["health"] == "ok" for g in groups.values() for r in g["rules"] if "health" in r)


def test_stopping_the_daemon_drains_it_and_the_replicas_keep_answering(stack: Stack) -> None:
    sh("podman", "stop", "-t", "30", DAEMON, timeout=120)
    logs = stack.logs("lmcache-server")
    assert "stopping: draining in-flight requests" in logs, logs[-2000:]
    assert "drained cleanly" in logs, logs[-2000:]
    for service in ("vllm-a", "vllm-b"):
        out = complete(stack.address(service), words(600, seed=7))
        assert out["usage"]["completion_tokens"] == 4


def test_compose_down_leaves_nothing_behind(stack: Stack) -> None:
    running = stack.leftovers()
    assert {"network lmcache-cpu_cache", "volume lmcache-cpu_lmcache-disk"} <= set(running), running
    stack.run("down", "-v")
    assert stack.leftovers() == []


if __name__ == "__main__":  # pragma: no cover - a manual run: python tests/test_deploy_stack.py
    sys.exit(pytest.main([__file__, "-q"]))
