"""Stand-ins of vLLM 0.32's attention backends' cache writes, in plain torch.

Written from reading vLLM's backends, for the unit tests and the paged-copy
benchmark: they test our reading of vLLM, not vLLM (tests/integrations/vllm/test_vllm_real.py
runs the real one).  Each is ``write(key, value, cache, slot_mapping)`` with
``key``/``value`` of shape ``(tokens, heads, head_dim)`` and ``cache`` of
logical shape ``(blocks, heads, block_tokens, 2 * head_dim)``.
"""

from __future__ import annotations

from typing import Any

import torch


def cpu_write(key: Any, value: Any, cache: Any, slots: Any) -> None:
    """vLLM 0.32 CPU backend ("vec"): per (block, head) K as [D, N], then V as [N, D]."""
    blocks, _, n_tok, width = cache.shape
    d = width // 2
    region = torch.as_strided(cache, (blocks, cache.shape[1], 2 * n_tok * d), (cache.stride(0), cache.stride(1), 1))
    for i, slot in enumerate(slots.tolist()):
        b, n = divmod(slot, n_tok)
        region[b, :, n : n_tok * d : n_tok] = key[i]  # K[h, dim, n] at dim*N + n
        region[b, :, n_tok * d + n * d : n_tok * d + (n + 1) * d] = value[i]


def flash_write(key: Any, value: Any, cache: Any, slots: Any) -> None:
    """FlashAttention-style: ``cache.transpose(1, 2).split(D, -1)``, token rows K || V."""
    key_cache, value_cache = cache.transpose(1, 2).split(key.shape[-1], dim=-1)
    n_tok = cache.shape[2]
    for i, slot in enumerate(slots.tolist()):
        b, n = divmod(slot, n_tok)
        key_cache[b, n] = key[i]
        value_cache[b, n] = value[i]


def swizzled_write(key: Any, value: Any, cache: Any, slots: Any) -> None:
    """K in dim pairs per token ([D/2, N, 2], as a VNNI packing would): not affine."""
    blocks, heads, n_tok, width = cache.shape
    d = width // 2
    region = torch.as_strided(cache, (blocks, heads, 2 * n_tok * d), (cache.stride(0), cache.stride(1), 1))
    for i, slot in enumerate(slots.tolist()):
        b, n = divmod(slot, n_tok)
        for dim in range(d):
            region[b, :, (dim // 2) * n_tok * 2 + n * 2 + dim % 2] = key[i, :, dim]
        region[b, :, n_tok * d + n * d : n_tok * d + (n + 1) * d] = value[i]
