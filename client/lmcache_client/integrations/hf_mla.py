"""MLA models (DeepSeek V2/V3 style) in the Hugging Face adapter: their cache is the latent.

transformers (5.x) caches an MLA layer compressed, as vLLM does: per layer the
cache's ``keys`` are ``kv_c_normed`` ``(batch, 1, tokens, kv_lora_rank)`` and its
``values`` the rotated ``k_pe`` ``(batch, 1, tokens, qk_rope_head_dim)``; the
attention expands them at every step.  So the adapter reads and writes the
same chunks as vLLM's connector (:class:`~.chunklayout.MLAChunkLayout`: per token
``kv_c_normed || k_pe``, namespace ``tp0of1``, tag ``L1TC``).

Primitives: :func:`mla_layout` (the layout of a config, None for other models),
:func:`mla_cache_from`, :func:`mla_stage`.
"""

from __future__ import annotations

from typing import Any

from .chunklayout import MLAChunkLayout


def mla_layout(config: Any, chunk_size: int, dtype: str) -> MLAChunkLayout | None:
    """The chunk layout of an MLA text config (``kv_lora_rank`` and ``qk_rope_head_dim``
    set), None for any other model."""
    rank, rope = getattr(config, "kv_lora_rank", None), getattr(config, "qk_rope_head_dim", None)
    if not rank or not rope:
        return None
    return MLAChunkLayout.of(config.num_hidden_layers, int(rank) + int(rope), chunk_size, dtype)


def _rank(config: Any) -> int:
    return int(config.kv_lora_rank)


def mla_cache_from(staging: Any, layout: MLAChunkLayout, config: Any) -> Any:
    """A ``DynamicCache`` holding the latents of ``staging`` ``(chunks, *layout.shape)``
    (consecutive chunks from token 0)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    n = len(staging)
    if not n:
        return cache
    rank = _rank(config)
    layers, _, chunk, _, latent = layout.shape
    for layer in range(layers):
        rows = staging[:, layer, 0, :, 0].reshape(1, 1, n * chunk, latent)
        cache.update(rows[..., :rank].contiguous(), rows[..., rank:].contiguous(), layer)
    return cache


def mla_stage(cache: Any, layout: MLAChunkLayout, config: Any, staging: Any, start: int) -> None:
    """Copy the latents of tokens ``start ..`` into ``staging`` ``(chunks, *layout.shape)``."""
    layers = cache.layers
    if len(layers) != layout.num_layers:
        raise ValueError(f"the cache has {len(layers)} layers, the model config {layout.num_layers}")
    rank = _rank(config)
    m, chunk = len(staging), layout.chunk_size
    end = start + m * chunk
    for layer, entry in enumerate(layers):
        keys, values = entry.keys, entry.values
        if keys.shape[-1] != rank or keys.shape[1] != 1:
            raise ValueError(f"layer {layer} caches {tuple(keys.shape)}, not a latent of {rank} (an MLA cache)")
        staging[:, layer, 0, :, 0, :rank].copy_(keys[0, 0, start:end].reshape(m, chunk, rank))
        staging[:, layer, 0, :, 0, rank:].copy_(values[0, 0, start:end].reshape(m, chunk, -1))
