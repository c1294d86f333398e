"""What vLLM's rotary embedding does to MLA's strided q_pe / k_pe (runs in vLLM's venv, no engine).

``python -m tests.integrations.vllm.vllm_harness.mla_rope SPEC.json OUT.json``: for
each of vLLM's rope paths, the CPU custom op (``custom_ops`` default) and its
PyTorch rope (``-rotary_embedding``), it builds the rope the tiny DeepSeek-V2
builds (``get_rope(64, is_neox_style=False)``), runs it on views laid out as
``MultiHeadLatentAttentionWrapper.forward`` passes them (``q_pe`` inside
``q`` ``(T, H, 32 + 64)``, ``k_pe`` inside the ``kv_a_proj_with_mqa`` output
``(T, 512 + 64)``), and writes, per path:

- ``k_at``: for each token ``t`` of the step, the index ``i`` of the step's token
  whose position its ``k_pe`` was rotated at (``-1``: left unrotated, ``None``:
  none of them), found by comparing with the PyTorch rope at every position;
- ``q_at``: the same for each query head, ``[t][h]``;
- ``refusal``: what the connector's start-time check (:mod:`.mlarope`) says.

SPEC: ``{"tokens": T, "heads": H}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

NOPE, ROPE, LORA = 32, 64, 512


def _index_of(got: Any, original: Any, positions: Any, rope: Any) -> int | None:
    """The step index whose position ``original`` ((1, R)) was rotated at to give ``got``."""
    import torch

    if torch.equal(got, original):
        return -1
    for i in range(len(positions)):
        _, want = rope.forward_native(positions[i : i + 1], torch.zeros(1, 1, ROPE), original.unsqueeze(0).clone())
        if torch.allclose(got, want[0], atol=1e-5):
            return i
    return None


def measure(custom_ops: list[str], tokens: int, heads: int) -> dict[str, Any]:
    import torch
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding

    from lmcache_client.integrations.vllm.mlarope import check_mla_rope

    rotary_embedding._ROPE_DICT.clear()  # one rope per configuration and process: build this one's
    config = VllmConfig(compilation_config=CompilationConfig(custom_ops=custom_ops))
    with set_current_vllm_config(config):
        rope = rotary_embedding.get_rope(ROPE, 4096, False, {"rope_theta": 10000.0}, torch.float32)
    gen = torch.Generator().manual_seed(0)
    positions = torch.arange(tokens) * 37 + 11
    q = torch.randn(tokens, heads, NOPE + ROPE, generator=gen)
    kv = torch.randn(tokens, LORA + ROPE, generator=gen)
    q0, kv0 = q.clone(), kv.clone()
    got_q, got_k = rope(positions, q[..., NOPE:], kv[:, LORA:].unsqueeze(1))
    k_at = [_index_of(got_k[t], kv0[t : t + 1, LORA:], positions, rope) for t in range(tokens)]
    q_at = [
        [_index_of(got_q[t, h : h + 1], q0[t, h : h + 1, NOPE:], positions, rope) for h in range(heads)]
        for t in range(tokens)
    ]

    class Attention:  # the dimensions the check reads from vLLM's MLAAttention
        qk_rope_head_dim, qk_nope_head_dim, kv_lora_rank, num_heads = ROPE, NOPE, LORA, heads

    refusal = check_mla_rope(Attention(), None, config, torch.float32, torch.device("cpu"))
    return {"method": rope._forward_method.__name__, "k_at": k_at, "q_at": q_at, "refusal": refusal}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    out = {
        name: measure(ops, spec["tokens"], spec["heads"])
        for name, ops in (("cpu_op", ["all"]), ("native", ["all", "-rotary_embedding"]))
    }
    Path(argv[1]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
