"""Where an engine's paged KV cache keeps each token's K and V, found by asking the engine.

A paged engine keeps, per attention layer, one cache tensor of *logical* shape
``(blocks, heads, tokens_in_block, content)``; how K and V of one (token,
head, dim) sit inside a block is the attention backend's business and
changes between backends and releases (vLLM 0.32's CPU backend keeps K of
each head transposed, ``[head_dim, block_size]``, and V token-major; its
FlashAttention-style backends keep ``K || V`` per token, in NHD or HND block
order).  Rather than assume any of that, :func:`probe_block_layout` lets the
engine's own cache-write function write encoded values into a scratch block
and reads back where every (K/V, token, head, dim) landed:

- when the positions are an affine function of (token, head, dim) for K and
  for V (every backend seen so far), the result is a :class:`BlockLayout` of
  strides, and copies are strided tensor views: one copy per block run;
- otherwise (a packed or swizzled layout) it keeps the full position table
  and copies gather/scatter through it: slower, still exact;
- a write that does not put every element exactly once is refused
  (:class:`LayoutError`), never guessed.

The copies themselves are :mod:`.paged`'s.

Primitives: :class:`Affine`, :class:`BlockLayout`, :func:`probe_block_layout`,
:class:`LayoutError`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any


def _torch() -> Any:
    import torch

    return torch


class LayoutError(ValueError):
    """A KV cache whose layout cannot be read with certainty."""


@dataclasses.dataclass(frozen=True)
class Affine:
    """Element offset of (token, head, dim) inside a block: ``base + token*t + head*h + dim*d``."""

    base: int
    token: int
    head: int
    dim: int


WriteFn = Callable[[Any, Any, Any, Any], None]
"""``write(key, value, cache, slot_mapping)``: the engine's cache write.  ``key`` and
``value`` are ``(tokens, heads, head_dim)``; ``slot_mapping[i]`` is ``block * block_tokens
+ offset`` of token ``i`` in ``cache`` (logical shape ``(blocks, heads, block_tokens, C)``)."""


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """Where K and V live inside one (kernel) block of a layer cache, in elements.

    ``key``/``value`` are set for affine layouts; otherwise ``positions`` holds the
    offset of every ``(kv, token, head, dim)`` (an int64 tensor of that shape).
    Offsets are relative to the block's first element; blocks are ``stride(0)`` of
    the layer tensor apart.
    """

    block_tokens: int
    num_heads: int
    head_dim: int
    key: Affine | None = None
    value: Affine | None = None
    positions: Any = None
    description: str = ""

    @property
    def affine(self) -> bool:
        return self.key is not None and self.value is not None


# Integers a dtype holds exactly (and negative one, the "not written" mark).
_EXACT_BITS = {"float32": 24, "float64": 53, "float16": 11, "bfloat16": 8, "float8_e4m3fn": 4, "float8_e5m2": 3}


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def probe_block_layout(
    write: WriteFn,
    *,
    block_tokens: int,
    num_heads: int,
    head_dim: int,
    content: int,
    strides: Sequence[int],
    dtype: Any,
    input_dtype: Any = None,
    device: Any = "cpu",
) -> BlockLayout:
    """Find where ``write`` puts K and V in a block of a cache with these inner
    ``strides`` (of heads, tokens, content, in elements of ``dtype``).

    Every element's canonical index ``((kv*T + t)*H + h)*D + d`` is written, in
    digits small enough for the cache dtype to hold exactly (several passes for
    narrow dtypes), into a scratch block laid out like the real one; the
    positions read back give the layout.  ``input_dtype`` is the dtype of the
    key/value tensors ``write`` expects (the model dtype; default ``dtype``)."""
    torch = _torch()
    name = _dtype_name(dtype)
    if name not in _EXACT_BITS:
        raise LayoutError(f"cannot probe a KV cache of dtype {name}")
    sh, sn, sc = (int(s) for s in strides)
    shape = (1, num_heads, block_tokens, content)
    span = 1 + (num_heads - 1) * sh + (block_tokens - 1) * sn + (content - 1) * sc
    total = 2 * block_tokens * num_heads * head_dim
    base = 2 ** _EXACT_BITS[name]
    passes = max(1, math.ceil(math.log(total, base))) if total > 1 else 1
    index = torch.arange(total, dtype=torch.int64, device=device).view(2, block_tokens, num_heads, head_dim)
    slots = torch.arange(block_tokens, dtype=torch.int64, device=device)
    found = torch.zeros(span, dtype=torch.int64, device=device)
    written = None
    for p in range(passes):
        digit = (index // base**p) % base
        flat = torch.full((span,), -1.0, dtype=dtype, device=device)
        cache = torch.as_strided(flat, shape, (span, sh, sn, sc))
        key, value = (digit[kv].to(input_dtype or dtype) for kv in (0, 1))
        write(key, value, cache, slots)
        readback = flat.to(torch.float64)
        mask = readback >= 0
        if written is None:
            written = mask
        elif not torch.equal(mask, written):
            raise LayoutError("the cache write touched different elements from pass to pass")
        found += torch.where(mask, readback, torch.zeros_like(readback)).to(torch.int64) * base**p
    assert written is not None
    offsets = torch.nonzero(written).flatten()
    values = found[offsets]
    if offsets.numel() != total or not torch.equal(torch.sort(values).values, torch.arange(total, device=device)):
        raise LayoutError(
            f"the cache write put {offsets.numel()} elements where {total} (K and V of {block_tokens} tokens x "
            f"{num_heads} heads x {head_dim}) were expected, or not each exactly once"
        )
    positions = torch.empty(total, dtype=torch.int64, device=device)
    positions[values] = offsets
    positions = positions.view(2, block_tokens, num_heads, head_dim).cpu()
    key_map, value_map = (_fit_affine(positions[kv]) for kv in (0, 1))
    if key_map is not None and value_map is not None:
        return BlockLayout(
            block_tokens, num_heads, head_dim, key_map, value_map, description=_describe(key_map, value_map)
        )
    return BlockLayout(
        block_tokens, num_heads, head_dim, positions=positions, description="position table (not affine)"
    )


def _fit_affine(pos: Any) -> Affine | None:
    """``pos[t, h, d]`` as base + t*st + h*sh + d*sd, or None when it is not of that form."""
    torch = _torch()
    tokens, heads, dim = pos.shape
    base = int(pos[0, 0, 0])
    st = int(pos[1, 0, 0]) - base if tokens > 1 else 0
    sh = int(pos[0, 1, 0]) - base if heads > 1 else 0
    sd = int(pos[0, 0, 1]) - base if dim > 1 else 0
    grid = (
        base
        + torch.arange(tokens).view(-1, 1, 1) * st
        + torch.arange(heads).view(1, -1, 1) * sh
        + torch.arange(dim).view(1, 1, -1) * sd
    )
    return Affine(base, st, sh, sd) if torch.equal(grid, pos) else None


def _describe(key: Affine, value: Affine) -> str:
    def one(a: Affine) -> str:
        order = sorted((("token", a.token), ("head", a.head), ("dim", a.dim)), key=lambda x: -abs(x[1]))
        return "[" + ", ".join(n for n, _ in order) + f"] @ {a.base}"

    return f"K {one(key)}, V {one(value)}"
