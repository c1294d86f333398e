"""HF transformers adapter against the real daemon: reuse changes cost, never output.

A 4-layer Llama with GQA (4 heads, 2 KV heads) and seeded random weights,
built from a config (no download); chunks of 16 tokens so short prompts span
several chunks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from lmcache_client import CacheClient, chunk_keys  # noqa: E402
from lmcache_client.integrations.hf import CachedPrefill  # noqa: E402

from ..conftest import Daemon  # noqa: E402
from ._hf_replica import VOCAB, build_model, count_model_tokens  # noqa: E402

CHUNK = 16
MODEL_ID = "test/llama-4L-256-gqa"
REPLICA = Path(__file__).with_name("_hf_replica.py")


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, VOCAB, (n,), generator=g)]


@pytest.fixture(scope="module")
def shared_daemon(module_daemon_factory: Callable[..., Daemon]) -> Daemon:
    return module_daemon_factory()


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    return {"float32": build_model(), "bfloat16": build_model(torch.bfloat16)}


@pytest.fixture
def client(shared_daemon: Daemon) -> Iterator[CacheClient]:
    with CacheClient(shared_daemon.address, timeout_s=10.0, fail_open=False) as c:
        yield c


def adapter_for(model: Any, client: CacheClient, request: pytest.FixtureRequest) -> CachedPrefill:
    """An adapter in a namespace of its own (the test's name as tenant)."""
    tenant = request.node.name.replace("[", "-").replace("]", "")
    return CachedPrefill(model, client, model_id=MODEL_ID, chunk_size=CHUNK, tenant=tenant)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_generation_same_with_and_without_reuse(
    models: dict[str, Any], client: CacheClient, dtype: str, request: pytest.FixtureRequest
) -> None:
    model = models[dtype]
    adapter = adapter_for(model, client, request)
    prompt = tokens(100, seed=1)
    ids = torch.tensor([prompt])
    plain = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(prompt) :].tolist()
    assert len(set(plain)) > 3, "the test model should not just repeat one token"

    cold = adapter.generate(prompt, 8)
    assert cold.prefill.reused_tokens == 0 and cold.prefill.saved_chunks == 100 // CHUNK
    warm = adapter.generate(prompt, 8)
    assert warm.prefill.reused_tokens == 96 and warm.prefill.computed_tokens == 4
    assert cold.tokens == plain and warm.tokens == plain

    # Logits of every recomputed position match a full forward pass within dtype tolerance.
    reused = adapter.prefill(prompt, all_logits=True, save=False)
    with torch.inference_mode():
        full = model(ids).logits[0, reused.reused_tokens :]
    tolerance = 1e-4 if dtype == "float32" else 5e-2
    assert reused.logits.dtype == getattr(torch, dtype)
    torch.testing.assert_close(reused.logits[0].float(), full.float(), atol=tolerance, rtol=tolerance)


def test_shared_prefix_runs_the_model_over_the_suffix_only(
    models: dict[str, Any], client: CacheClient, request: pytest.FixtureRequest
) -> None:
    model = models["float32"]
    adapter = adapter_for(model, client, request)
    prefix = tokens(64, seed=2)
    first, second = prefix + tokens(20, seed=3), prefix + tokens(13, seed=4)
    seen, hook = count_model_tokens(model)
    try:
        a = adapter.prefill(first)
        assert sum(seen) == 84 and a.reused_tokens == 0 and a.saved_chunks == 5
        seen.clear()
        b = adapter.prefill(second)
        assert (b.reused_tokens, b.computed_tokens) == (64, 13)
        assert sum(seen) == 13, "the model must process only the 13 suffix tokens"
    finally:
        hook.remove()
    with torch.inference_mode():
        expected = model(torch.tensor([second])).logits[0, -1]
    torch.testing.assert_close(b.logits[0, -1], expected, atol=1e-4, rtol=1e-4)


def test_unaligned_prompt_reuses_full_chunks_and_recomputes_the_tail(
    models: dict[str, Any], client: CacheClient, request: pytest.FixtureRequest
) -> None:
    adapter = adapter_for(models["float32"], client, request)
    prompt = tokens(75, seed=5)  # 4 full chunks + 11 tokens without a key
    first = adapter.prefill(prompt)
    assert first.saved_chunks == 4
    again = adapter.prefill(prompt)
    assert (again.reused_tokens, again.computed_tokens) == (64, 11)
    assert again.saved_chunks == 0  # nothing new to store


def test_a_hit_never_covers_the_whole_prompt(
    models: dict[str, Any], client: CacheClient, request: pytest.FixtureRequest
) -> None:
    adapter = adapter_for(models["float32"], client, request)
    prompt = tokens(64, seed=6)  # exactly 4 chunks, all stored by the first run
    assert adapter.prefill(prompt).saved_chunks == 4
    assert client.lookup(chunk_keys(prompt, CHUNK), namespace=adapter.namespace).hit_chunks == 4
    again = adapter.prefill(prompt)
    assert (again.reused_tokens, again.computed_tokens) == (48, 16)
    assert again.logits.shape == (1, 1, VOCAB)
    one_chunk = adapter.prefill(prompt[:CHUNK])  # its only chunk is stored, still computed
    assert one_chunk.reused_tokens == 0 and one_chunk.computed_tokens == CHUNK


def test_chunk_layout_and_namespace_follow_the_model(
    models: dict[str, Any], client: CacheClient, request: pytest.FixtureRequest
) -> None:
    for dtype, element in (("float32", 4), ("bfloat16", 2)):
        adapter = adapter_for(models[dtype], client, request)
        assert adapter.namespace.wire() == (
            f"{MODEL_ID}|{dtype}|L4|KV2|D64|tp0of1|c16|layout=L2THD|tenant={request.node.name}"
        )
        prompt = tokens(40, seed=7)
        adapter.prefill(prompt)
        [payload] = client.get(chunk_keys(prompt, CHUNK)[:1], namespace=adapter.namespace)
        assert payload is not None and len(payload) == 4 * 2 * CHUNK * 2 * 64 * element


def test_a_wrong_sized_chunk_is_never_loaded(
    models: dict[str, Any], client: CacheClient, request: pytest.FixtureRequest
) -> None:
    model = models["float32"]
    adapter = adapter_for(model, client, request)
    prompt = tokens(70, seed=8)
    keys = chunk_keys(prompt, CHUNK)
    adapter.prefill(prompt[: CHUNK * 2 + 1])  # stores chunks 0 and 1
    client.put(keys[2:3], [b"\0" * 100], namespace=adapter.namespace)  # chunk 2: garbage of the wrong size
    result = adapter.prefill(prompt, save=False)
    assert result.reused_tokens == 32  # stops before the bad chunk
    with torch.inference_mode():
        expected = model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(result.logits[0, -1], expected, atol=1e-4, rtol=1e-4)


def test_daemon_down_means_full_prefill(models: dict[str, Any], request: pytest.FixtureRequest) -> None:
    model = models["float32"]
    prompt = tokens(50, seed=9)
    with CacheClient("tcp://127.0.0.1:9", timeout_s=0.2) as dead:  # nothing listens on port 9
        adapter = adapter_for(model, dead, request)
        result = adapter.generate(prompt, 4)
        assert result.prefill.reused_tokens == 0 and result.prefill.saved_chunks == 0
    plain = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert result.tokens == plain[0, len(prompt) :].tolist()


def test_two_replicas_share_the_prefix(
    models: dict[str, Any], shared_daemon: Daemon, request: pytest.FixtureRequest
) -> None:
    """Replica A (this process) computes a prompt; replica B, a separate Python process
    with its own copy of the model, gets its first request's prefix from the daemon."""
    prefix = tokens(80, seed=10)
    prompt_a, prompt_b = prefix + tokens(7, seed=11), prefix + tokens(9, seed=12)
    tenant = request.node.name
    argv = [sys.executable, str(REPLICA), shared_daemon.address, MODEL_ID, tenant, ",".join(map(str, prompt_b))]
    replica_b = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with CacheClient(shared_daemon.address, timeout_s=10.0, fail_open=False) as client:
            a = CachedPrefill(models["float32"], client, model_id=MODEL_ID, chunk_size=CHUNK, tenant=tenant)
            first = a.prefill(prompt_a)  # while B imports torch
        assert (first.reused_tokens, first.saved_chunks) == (0, 87 // CHUNK)
        out, err = replica_b.communicate("go\n", timeout=100)
        assert replica_b.returncode == 0, err
    finally:
        if replica_b.poll() is None:
            replica_b.kill()
            replica_b.wait()
    b = json.loads(out.strip().splitlines()[-1])
    assert (b["reused_tokens"], b["computed_tokens"], b["model_tokens"]) == (80, 9, 9)
    with torch.inference_mode():
        expected = int(models["float32"](torch.tensor([prompt_b])).logits[0, -1].argmax())
    assert b["next_token"] == expected
