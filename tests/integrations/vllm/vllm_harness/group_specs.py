"""vLLM's own KV cache spec classes through the connector's group reading (runs in vLLM's venv).

``python -m tests.integrations.vllm.vllm_harness.group_specs SPEC OUT`` (SPEC is
ignored) builds ``KVCacheConfig`` objects from vLLM 0.32's real
``FullAttentionSpec``, ``SlidingWindowSpec``, ``MambaSpec``,
``ChunkedLocalAttentionSpec``, ``CrossAttentionSpec`` and
``SlidingWindowMLASpec`` and writes what
:func:`~lmcache_client.integrations.vllm.groups.group_infos` makes of each: the
groups it reads, or the one refusal message.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from vllm.v1 import kv_cache_interface as kci

from lmcache_client.integrations.vllm.groups import UnsupportedGroups, group_infos


def _config(*specs: Any) -> Any:
    groups = [kci.KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], spec) for i, spec in enumerate(specs)]
    return kci.KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


def main(argv: list[str]) -> int:
    attention = {"block_size": 128, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
    full = kci.FullAttentionSpec(**attention)
    sliding = kci.SlidingWindowSpec(**attention, sliding_window=128)
    cases = {
        "full": _config(full),
        "full+sliding": _config(sliding, full),
        "unified": _config(kci.FullAttentionSpec(**attention, sliding_window=128)),  # the manager off
        "mamba": _config(
            full,
            kci.MambaSpec(block_size=128, shapes=((3, 64), (2, 16, 16)), dtypes=(torch.float32, torch.float32)),
        ),
        "chunked_local": _config(full, kci.ChunkedLocalAttentionSpec(**attention, attention_chunk_size=64)),
        "cross+swa_mla": _config(
            kci.CrossAttentionSpec(**attention),
            kci.SlidingWindowMLASpec(
                block_size=128, num_kv_heads=1, head_size=576, dtype=torch.float32, sliding_window=64
            ),
        ),
    }
    out: dict[str, Any] = {}
    for name, config in cases.items():
        try:
            out[name] = [[g.kind, g.block_size, g.sliding_window, list(g.layer_names)] for g in group_infos(config)]
        except UnsupportedGroups as err:
            out[name] = f"UnsupportedGroups: {err}"
    Path(argv[1]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
