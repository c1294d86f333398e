"""Mamba / GDN state through the daemon, against vLLM's own spec classes (run in vLLM's venv).

``python -m tests.integrations.vllm.vllm_harness.mamba_state SPEC OUT``; SPEC:
``{"address": ..., "block_size": 1152, "chunk_size": 256}``.  It builds the
KV cache config of the tiny Qwen3-Next of ``models.py`` (three GDN layers,
each a ``MambaSpec`` group, one full-attention group; the state shapes and
dtypes from vLLM's own ``MambaStateShapeCalculator`` / ``MambaStateDtypeCalculator``,
the page padding the real engine logs), lays the caches out as vLLM does (one
padded page per block, each state part a strided view into it), and runs
:mod:`lmcache_client.integrations.vllm.mamba` against them: engine A saves the
state of blocks (5, 6, 7) after 2 blocks of tokens, engine B (other caches)
looks it up and loads it into blocks (9, 10, 11).  OUT gets the byte counts,
hits and misses, and every refusal's message; the test asserts on them.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

from lmcache_client.client import CacheClient
from lmcache_client.integrations.vllm.mamba import StateLayout, UnsupportedState, state_key
from lmcache_client.namespace import Namespace

from .models import prompt_tokens

NUM_BLOCKS, PAGE = 16, 294912  # the tiny Qwen3-Next's padded page (vLLM logs it at start)
GDN_LAYERS = ["model.layers.0.linear_attn", "model.layers.1.linear_attn", "model.layers.2.linear_attn"]


def gdn_spec(block_size: int, mode: str = "align", tp_size: int = 1) -> MambaSpec:
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(tp_size, 2, 4, 128, 128, 4)
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(torch.bfloat16, "auto", "float32")
    return MambaSpec(
        block_size=block_size,
        shapes=tuple(shapes),
        dtypes=tuple(dtypes),
        page_size_padded=PAGE,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode=mode,
    )


def config(block_size: int, mode: str = "align") -> KVCacheConfig:
    groups = [KVCacheGroupSpec([name], gdn_spec(block_size, mode)) for name in GDN_LAYERS]
    attention = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    groups.append(KVCacheGroupSpec(["model.layers.3.self_attn.attn"], attention))
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


def caches(spec: MambaSpec, fill: bool, seed: int) -> tuple[dict[str, list[Any]], list[torch.Tensor]]:
    """Each layer's state parts as vLLM views them: strided over one padded page per block."""
    out: dict[str, list[Any]] = {}
    raws: list[torch.Tensor] = []
    gen = torch.Generator().manual_seed(seed)
    for name in GDN_LAYERS:
        raw = torch.zeros(NUM_BLOCKS * PAGE, dtype=torch.uint8)
        if fill:
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        parts, offset = [], 0
        for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
            size = torch.empty((), dtype=dtype).element_size()
            typed = raw.view(dtype)
            strides = [PAGE // size] + [int(torch.tensor(shape[i + 1 :]).prod()) for i in range(len(shape))]
            parts.append(typed.as_strided((NUM_BLOCKS, *shape), tuple(strides), offset // size))
            offset += int(torch.tensor(shape).prod()) * size
        out[name] = parts
        raws.append(raw)
    return out, raws


def refusal(fn: Any) -> str:
    try:
        fn()
    except (UnsupportedState, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return "accepted"


def main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    bs, chunk = spec["block_size"], spec["chunk_size"]
    cfg = config(bs)
    layout = StateLayout.from_kv_cache_config(cfg)
    assert layout is not None
    mspec = cfg.kv_cache_groups[0].kv_cache_spec
    kv_ns = Namespace("tiny-qwen3-next", "bfloat16", 1, 2, 32, chunk)
    ns = layout.namespace(kv_ns)
    prompt = prompt_tokens(3 * bs + 100, seed=7)
    n = 2 * bs
    a_caches, a_raw = caches(mspec, fill=True, seed=1)
    b_caches, b_raw = caches(mspec, fill=False, seed=2)
    a, b = layout.bind(a_caches), layout.bind(b_caches)
    payload = a.gather([5, 6, 7])
    key = state_key(prompt, n, chunk)
    others = {m: state_key(prompt, m, chunk) for m in (n - bs, n - 1, n + 1, n + bs)}
    with CacheClient(spec["address"], timeout_s=10) as client:
        put = client.put([key], [payload], namespace=ns)
        hit = client.lookup([key], namespace=ns).hit_chunks
        other_hits = {m: client.lookup([k], namespace=ns).hit_chunks for m, k in others.items()}
        in_kv_namespace = client.exists([key], namespace=kv_ns)
        got = client.get([key], namespace=ns)[0]
    assert got is not None
    b.scatter([9, 10, 11], got)
    wrong = 0
    for name, src, dst in zip(GDN_LAYERS, (5, 6, 7), (9, 10, 11), strict=True):
        for pa, pb in zip(a_caches[name], b_caches[name], strict=True):
            wrong += int((pa[src].contiguous().view(torch.uint8) != pb[dst].contiguous().view(torch.uint8)).sum())
    # every byte of B outside the loaded state (other blocks, page padding) is still zero
    touched = sum(int((raw != 0).sum()) for raw in b_raw)
    swapped = a_caches[GDN_LAYERS[1]][::-1]  # parts in the wrong order
    out = {
        "state_bytes": layout.state_bytes,
        "payload_bytes": len(payload),
        "page_bytes": mspec.page_size_bytes,
        "real_page_bytes": mspec.real_page_size_bytes,
        "block_size": layout.block_size,
        "tag": layout.tag(),
        "namespace": ns.wire(),
        "kv_namespace": kv_ns.wire(),
        "put": [int(s) for s in put],
        "hit": hit,
        "other_hits": {str(m): h for m, h in other_hits.items()},
        "in_kv_namespace": in_kv_namespace,
        "wrong_bytes": wrong,
        "nonzero_bytes_in_b": touched,
        "refusals": {
            "mode_none": refusal(lambda: StateLayout.from_kv_cache_config(config(bs, "none"))),
            "wrong_shape": refusal(lambda: layout.bind({**a_caches, GDN_LAYERS[1]: swapped})),
            "missing_layer": refusal(lambda: layout.bind({k: v for k, v in a_caches.items() if k != GDN_LAYERS[2]})),
            "null_block": refusal(lambda: a.gather([0, 6, 7])),
            "short_payload": refusal(lambda: b.scatter([9, 10, 11], payload[:-1])),
        },
    }
    # a TP-2 rank's GDN state is another geometry: another namespace, never mixed
    tp2 = dataclasses.replace(cfg, kv_cache_groups=[KVCacheGroupSpec([n], gdn_spec(bs, tp_size=2)) for n in GDN_LAYERS])
    tp2_layout = StateLayout.from_kv_cache_config(tp2)
    assert tp2_layout is not None
    out["tp2_namespace"] = tp2_layout.namespace(dataclasses.replace(kv_ns, tp_rank=1, tp_size=2)).wire()
    Path(out_path).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
