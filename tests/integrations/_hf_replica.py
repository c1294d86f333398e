"""One engine replica for the two-replica test: a separate process using the HF adapter.

``python tests/integrations/_hf_replica.py ADDRESS MODEL_ID TENANT TOKENS`` builds the test
model (same seed as the tests), waits for a line on stdin (so it can import
torch while the other replica computes, and still run after it), prefills
the comma-separated TOKENS through the daemon and prints one JSON line: what
was reused, what the model computed, what was stored and the next token.
Also imported by the tests for :func:`build_model`.
"""

from __future__ import annotations

import json
import sys
from typing import Any

VOCAB = 512


def build_model(dtype: Any = None) -> Any:
    """A 4-layer Llama (hidden 256, 4 heads, 2 KV heads) with seeded random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.1,  # larger than the default so greedy decoding does not just repeat
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    return model.to(dtype) if dtype is not None else model


def count_model_tokens(model: Any) -> tuple[list[int], Any]:
    """A list that grows by the number of tokens of every forward pass of ``model``,
    and the hook's handle (``.remove()`` it when done)."""
    seen: list[int] = []
    handle = model.get_input_embeddings().register_forward_pre_hook(lambda _m, args: seen.append(int(args[0].numel())))
    return seen, handle


def main(argv: list[str]) -> int:
    address, model_id, tenant, tokens = argv
    from lmcache_client import CacheClient
    from lmcache_client.integrations.hf import CachedPrefill

    model = build_model()
    seen, _ = count_model_tokens(model)
    sys.stdin.readline()
    with CacheClient(address, timeout_s=10.0, fail_open=False) as client:
        adapter = CachedPrefill(model, client, model_id=model_id, chunk_size=16, tenant=tenant)
        result = adapter.prefill([int(t) for t in tokens.split(",")])
    report = {
        "reused_tokens": result.reused_tokens,
        "computed_tokens": result.computed_tokens,
        "model_tokens": sum(seen),
        "saved_chunks": result.saved_chunks,
        "next_token": int(result.logits[0, -1].argmax()),
    }
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
