"""Two real vLLM OpenAI servers on two daemons (two "nodes") that share nothing but a real
Mooncake Store (a ``mooncake_master`` with its HTTP metadata server; no Redis): a prompt
replica A computed is loaded by replica B from Mooncake, with the same answer, and B's
response says where its prompt tokens came from."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ...conftest import Daemon, MooncakeMaster, free_port, wait_for
from .test_vllm_server import CHUNK, complete, counters, server_model
from .vllm_harness.fixtures import Server, doc_command, loadable, server_env
from .vllm_harness.models import prompt_tokens

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def nodes(
    module_daemon_factory: Callable[..., Daemon],
    vllm_python: Path,
    models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("vllm-mooncake")
    master = MooncakeMaster(work / "mooncake").start()
    servers: list[Server] = []
    daemons: list[Daemon] = []
    try:
        for name in ("a", "b"):
            daemon = module_daemon_factory(max_local_cpu_size="512MiB", **master.daemon_config())
            daemons.append(daemon)
            env = server_env(vllm_python, models["llama"], free_port(), daemon.address)
            servers.append(Server(doc_command("vllm-replica-command-cpu"), env, int(env["PORT"]), work / f"{name}.log"))
        for server in servers:
            server.wait_ready()
        yield {"servers": servers, "daemons": daemons, "master": master}
    finally:
        for server in servers:
            server.stop()
        master.stop()


def mooncake_stats(daemon: Daemon) -> dict[str, Any]:
    with daemon.client() as c:
        return c.stats()["tiers"]["mooncake"]  # type: ignore[no-any-return]


def test_replica_b_loads_replica_a_prompt_from_mooncake(nodes: dict[str, Any]) -> None:
    a, b = nodes["servers"]
    daemon_a, daemon_b = nodes["daemons"]
    prompt = prompt_tokens(1100, seed=41)
    answer_a = complete(a, prompt)
    chunks = len(prompt) // CHUNK
    wait_for(lambda: counters(a).get("stored_chunks", 0) >= chunks, 60)
    # A's daemon wrote them behind, into the cluster pool.
    wait_for(lambda: mooncake_stats(daemon_a)["stores"] >= chunks and mooncake_stats(daemon_a)["queued_writes"] == 0)
    before = counters(b).get("loaded_tokens", 0)
    out = b.post(
        "/v1/completions",
        {"model": server_model(b), "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
    )
    assert out["choices"][0]["text"].split() == answer_a
    assert counters(b)["loaded_tokens"] - before == loadable(len(prompt), CHUNK)
    sources = out["kv_transfer_params"]["lmcache_prompt_sources"]
    assert sources.get("mooncake") == loadable(len(prompt), CHUNK) and sum(sources.values()) == len(prompt), sources
    stats_b = mooncake_stats(daemon_b)
    assert stats_b["hits"] >= chunks and stats_b["corrupt"] == 0
    # Now in B's own pool: the same prompt again is a memory hit there (vLLM's own cache aside).
    with daemon_b.client() as c:
        assert c.stats()["tiers"]["memory"]["chunks"] >= chunks
