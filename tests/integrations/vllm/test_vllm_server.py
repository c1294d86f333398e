"""Two real vLLM OpenAI servers sharing one daemon, started with the command lines
of docs/integrations.md (run verbatim: A the canonical `vllm serve` line, B its
CPU-build variant), over real HTTP.

In order, on the same two servers (each costs ~45 s to start here):

1. the servers start while the daemon is absent and serve correct answers,
   the outage costing a bounded number of failed daemon calls;
2. the daemon starts: replica B's first request is served from replica A's chunks;
3. ``lmcache-warmup`` warms a system prompt through A, and B's first chat with
   that system prompt hits;
4. the daemon is killed mid-run: both keep answering the same, with a bounded
   number of failed daemon calls; it restarts on the same port and hits resume
   without restarting vLLM.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ...conftest import Daemon, free_port, wait_for
from .vllm_harness.fixtures import Server, doc_command, loadable, server_env
from .vllm_harness.models import prompt_tokens, word

pytestmark = pytest.mark.timeout(1800)
CHUNK = 256  # the connector's default


@pytest.fixture(scope="module")
def stack(
    module_daemon_factory: Callable[..., Daemon],
    vllm_python: Path,
    models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    """Two servers on a daemon address where nothing listens yet; ``start_daemon()`` starts it."""
    work = tmp_path_factory.mktemp("vllm-servers")
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    servers = []
    # A: the canonical line (`vllm serve`), B: its CPU-build variant (vLLM's server module).
    for name, block in (("a", "vllm-replica-command"), ("b", "vllm-replica-command-cpu")):
        http = free_port()
        env = server_env(vllm_python, models["llama"], http, address)
        servers.append(Server(doc_command(block), env, http, work / f"server-{name}.log"))
    state: dict[str, Any] = {"servers": servers, "port": port, "daemon": None, "work": work}

    def start_daemon() -> Daemon:
        daemon = module_daemon_factory(max_local_cpu_size="1GiB", port=port)
        state["daemon"] = daemon
        return daemon

    state["start_daemon"] = start_daemon
    try:
        for server in servers:
            server.wait_ready()
        yield state
    finally:
        for server in servers:
            server.stop()


def complete(server: Server, tokens: list[int], n: int = 6) -> list[int]:
    """Greedy completion of a token prompt; the generated token ids."""
    out = server.post(
        "/v1/completions",
        {"model": str(server_model(server)), "prompt": tokens, "max_tokens": n, "temperature": 0, "ignore_eos": True},
    )
    text = out["choices"][0]["text"]
    return text.split()  # word-level tokenizer: one word per token


_MODEL_NAMES: dict[int, str] = {}


def server_model(server: Server) -> str:
    """The served model name (the checkpoint path the command line gave)."""
    if server.port not in _MODEL_NAMES:
        _MODEL_NAMES[server.port] = str(_get(server.url + "/v1/models")["data"][0]["id"])
    return _MODEL_NAMES[server.port]


def _get(url: str) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        result: dict[str, Any] = json.loads(r.read())
    return result


def counters(server: Server) -> dict[str, float]:
    return {k.removeprefix("vllm:lmcache_server_").removesuffix("_total"): v for k, v in server.metrics().items()}


def test_replicas_serve_while_the_daemon_is_absent(stack: dict[str, Any]) -> None:
    a, b = stack["servers"]
    prompt = prompt_tokens(900, seed=10)
    answers = [complete(a, prompt), complete(b, prompt), complete(a, prompt[:700] + [5, 6])]
    assert answers[0] == answers[1] and answers[0] != answers[2]
    for server in (a, b):
        c = counters(server)
        assert c.get("loaded_tokens", 0) == 0
        # One failed call per process (scheduler, worker) opened its breaker; later calls were short-circuited.
        assert 1 <= c.get("daemon_failures", 0) <= 4, c
    stack["absent"] = (prompt, answers[0])


def test_replica_b_first_request_is_served_from_a(stack: dict[str, Any]) -> None:
    a, b = stack["servers"]
    stack["start_daemon"]()
    time.sleep(2.5)  # past the breakers' back-off: their next call probes and finds the daemon
    prompt = prompt_tokens(1100, seed=11)
    wait_for(lambda: complete(a, prompt) and counters(a).get("stored_chunks", 0) >= len(prompt) // CHUNK, 60)
    before = counters(b).get("loaded_tokens", 0)
    memory_before = b.vllm_metric("vllm:lmcache_server_prompt_tokens_total", source="memory")
    out = b.post(
        "/v1/completions",
        {"model": server_model(b), "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
    )
    answer_b = out["choices"][0]["text"].split()
    assert counters(b)["loaded_tokens"] - before == loadable(len(prompt), CHUNK)
    assert answer_b == complete(a, prompt)
    # Where the prompt's tokens came from: in the response, and in B's Prometheus counter.
    sources = out["kv_transfer_params"]["lmcache_prompt_sources"]
    assert sources["memory"] == loadable(len(prompt), CHUNK) and sum(sources.values()) == len(prompt), sources
    memory = b.vllm_metric("vllm:lmcache_server_prompt_tokens_total", source="memory")
    assert memory - memory_before == sources["memory"]
    stack["shared"] = (prompt, answer_b)


def test_warmup_through_a_warms_b(stack: dict[str, Any], tmp_path: Path) -> None:
    a, b = stack["servers"]
    system = " ".join(word(t) for t in prompt_tokens(700, seed=12))
    prompts = tmp_path / "hot.jsonl"
    prompts.write_text(json.dumps(system) + "\n")
    warm = subprocess.run(
        [str(Path(sys.executable).with_name("lmcache-warmup")), "--endpoint", a.url, "--model", server_model(a)]
        + ["--prompts", str(prompts)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert warm.returncode == 0, warm.stdout + warm.stderr
    before = counters(b).get("loaded_tokens", 0)
    b.post(
        "/v1/chat/completions",
        {
            "model": server_model(b),
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "w1 w2 w3"}],
            "max_tokens": 2,
        },
    )
    assert counters(b)["loaded_tokens"] - before >= 2 * CHUNK, "B's first chat missed the warmed system prompt"


def test_daemon_killed_mid_run_and_restarted(stack: dict[str, Any]) -> None:
    a, b = stack["servers"]
    prompt, answer = stack["shared"]
    before = {s.port: counters(s) for s in (a, b)}
    stack["daemon"].kill()
    started = time.monotonic()
    for i in range(5):  # each request looks up (beyond vLLM's own prefix hit) and stores
        for server in (a, b):
            assert complete(server, prompt) == answer
            assert complete(server, prompt[: 600 + i] + [7]) == complete(server, prompt[: 600 + i] + [7])
    outage_s = time.monotonic() - started
    # Per process (scheduler, worker): the call that found the daemon gone, then one
    # probe per back-off period (1 s, doubling): the bound grows with the log of the outage.
    bound = 2 * (1 + math.ceil(math.log2(1 + outage_s / 1.0)))
    for server in (a, b):
        c = counters(server)
        failures = c.get("daemon_failures", 0) - before[server.port].get("daemon_failures", 0)
        short = c.get("short_circuited", 0) - before[server.port].get("short_circuited", 0)
        assert 1 <= failures <= bound and short >= 1, (failures, short, bound)
    # Same port, a new empty daemon: stores and hits resume by themselves, once each
    # process's breaker has probed it (its back-off grew during the outage).
    stack["start_daemon"]()
    deadline = time.monotonic() + 120
    for seed in range(13, 1000):
        fresh = prompt_tokens(800, seed=seed)
        stored = counters(a).get("stored_chunks", 0)
        expected = complete(a, fresh)
        loaded = counters(b).get("loaded_tokens", 0)
        assert complete(b, fresh) == expected
        if counters(a)["stored_chunks"] > stored and counters(b)["loaded_tokens"] - loaded == 3 * CHUNK:
            break
        assert time.monotonic() < deadline, "hits never resumed after the daemon came back"
        time.sleep(1)
