"""What the worker holds of vLLM's KV cache layout, shared by the standard and the MLA discovery.

:class:`EngineLayout` (what :func:`.discovery.discover` and :func:`.mla.discover_mla`
return), :class:`UnsupportedLayout` (the one error a refused cache raises) and
the helpers both discoveries use to word a refusal and order the layers.
It imports neither discovery, so they import it without a circle.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..blocklayout import BlockLayout
from ..paged import PagedCopier
from .groups import GroupCopier

__all__ = ["EngineLayout", "UnsupportedLayout"]


class UnsupportedLayout(ValueError):
    """vLLM's KV caches are in a layout this connector does not read."""


@dataclasses.dataclass
class EngineLayout:
    """What the worker needs to move chunks in and out of vLLM's caches."""

    backend: str
    block_size: int
    """Tokens per scheduler block (the block ids vLLM's scheduler hands out)."""
    block_tokens: int
    """Tokens per kernel block (the layer tensors' third dimension)."""
    block: BlockLayout
    copier: PagedCopier
    layer_names: list[str]
    groups: list[GroupCopier] | None = None
    """With several KV cache groups (vLLM's hybrid manager): each group's copier, in
    vLLM's group order (``copier`` is then the first group's)."""

    def describe(self) -> str:
        kinds = f", groups {'+'.join(g.info.kind for g in self.groups)}" if self.groups else ""
        return (
            f"{self.backend}, {len(self.layer_names)} layers{kinds}, blocks of {self.block_size} tokens"
            f"{'' if self.block_tokens == self.block_size else f' (kernel blocks of {self.block_tokens})'}, "
            f"{self.block.description}"
        )


def _refuse(backend: str, shape: Any, reason: str) -> UnsupportedLayout:
    return UnsupportedLayout(
        f"lmcache-server connector cannot use vLLM's KV cache (attention backend {backend}, "
        f"per-layer shape {tuple(shape)}): {reason}"
    )


def _ordered(kv_caches: dict[str, Any]) -> list[str]:
    names = list(kv_caches)
    try:
        from vllm.model_executor.models.utils import extract_layer_index
    except ImportError:  # pragma: no cover - vLLM without the helper: keep vLLM's order
        return names
    try:
        return sorted(names, key=extract_layer_index)
    except (AssertionError, ValueError):
        return names


def _forward_context(vllm_config: Any) -> dict[str, Any]:
    """vLLM's layer name -> attention module table (``static_forward_context``)."""
    return getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", {}) or {}


def _first_layer(kv_caches: dict[str, Any], context: dict[str, Any]) -> tuple[list[str], Any, Any, Any, str]:
    """The layers in model order, the first one's cache tensor, attention module,
    implementation (None where ``context`` has none) and backend name."""
    names = _ordered(kv_caches)
    attention = context.get(names[0])
    backend = "unknown"
    if attention is not None and getattr(attention, "attn_backend", None) is not None:
        backend = str(attention.attn_backend.get_name())
    return names, kv_caches[names[0]], attention, getattr(attention, "impl", None), backend
