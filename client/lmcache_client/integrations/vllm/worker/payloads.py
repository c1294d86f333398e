"""Chunk payloads as tensors over the bytes the daemon lends (a pool slot, a frame).

A payload is ``(layers, 2, tokens, heads, dim)`` in the cache's dtype
(:class:`~...chunklayout.ChunkLayout`): a full chunk, the tokens of a load that
starts or ends inside it, or a prompt's partial last chunk (a tail).

Primitive: :class:`Payloads`.
"""

from __future__ import annotations

from typing import Any

from ...chunklayout import ChunkLayout


def _torch() -> Any:
    import torch

    return torch


class Payloads:
    """Tensors over chunk bytes, for one layout and the cache's ``dtype``."""

    def __init__(self, layout: ChunkLayout, dtype: Any):
        self.layout = layout
        self.dtype = dtype

    def of(self, view: memoryview, lo: int = 0, hi: int | None = None, *, tokens: int | None = None) -> Any:
        """A chunk payload tensor over ``view``: ``(layers, 2, tokens, heads, dim)``, tokens
        sliced; ``tokens``: a tail of that many tokens instead of a full chunk."""
        torch = _torch()
        flat = torch.frombuffer(view, dtype=torch.uint8) if view.nbytes else torch.empty(0, dtype=torch.uint8)
        shape = list(self.layout.shape)
        if tokens is not None:
            shape[2] = tokens
        payload = flat.view(self.dtype).view(shape)
        return payload if lo == 0 and hi is None else payload[:, :, lo:hi]

    def tail_bytes(self, tokens: int) -> int:
        """Bytes of a tail payload of ``tokens`` tokens."""
        return self.layout.nbytes // self.layout.chunk_size * tokens
