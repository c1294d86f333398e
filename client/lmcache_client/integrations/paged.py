"""Copies between vLLM's paged KV cache and chunk payloads, in plain torch.

vLLM (FlashAttention-style backends, NHD) keeps one tensor per attention
layer of logical shape ``(2, num_blocks, block_size, num_kv_heads, head_dim)``
(2 = K, V); token ``i`` of a request lives in block ``block_ids[i //
block_size]`` at offset ``i % block_size``.  A chunk payload (see
:mod:`.layout`) is ``(layers, 2, chunk_size, kv_heads, head_dim)``, so moving a
chunk is a gather or scatter of ``chunk_size`` token rows per layer.  Token
ranges need not be block aligned: a chunk may end inside a block and a
request's last block is usually partial.

Everything is done on byte views (``uint8``, last dim ``head_dim x element
size``), so fp8, bf16 and fp32 caches take the same code path, and on the
*logical* shape, so an HND stride order of the same logical tensor works too.

Primitives: :func:`check_layer`, :func:`token_slots`, :func:`gather_layer`,
:func:`scatter_layer`, :func:`blocks_covering`, and :func:`chunks_to_tokens` /
:func:`tokens_to_chunks` between chunk-major and token-major byte tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple


def _torch() -> Any:
    import torch

    return torch


class PagedShape(NamedTuple):
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int


def check_layer(kv_layer: Any) -> PagedShape:
    """The geometry of one layer's paged cache; raises for any other layout."""
    shape = tuple(kv_layer.shape)
    if len(shape) != 5 or shape[0] != 2:
        raise ValueError(f"expected a (2, num_blocks, block_size, kv_heads, head_dim) KV cache, got shape {shape}")
    if kv_layer.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim must be its innermost (contiguous) dimension")
    return PagedShape(*shape[1:])


def _bytes(kv_layer: Any) -> Any:
    """``kv_layer`` as uint8, last dim ``head_dim * element_size`` (same storage)."""
    torch = _torch()
    return kv_layer if kv_layer.dtype == torch.uint8 else kv_layer.view(torch.uint8)


def token_slots(block_ids: Sequence[int], start: int, end: int, block_size: int) -> tuple[Any, Any]:
    """(block index, offset in block) of tokens ``[start, end)`` of a request."""
    torch = _torch()
    if not 0 <= start <= end:
        raise ValueError(f"bad token range [{start}, {end})")
    if end > len(block_ids) * block_size:
        raise ValueError(f"token {end - 1} is past the request's {len(block_ids)} blocks of {block_size}")
    positions = torch.arange(start, end, dtype=torch.long)
    table = torch.as_tensor(list(block_ids), dtype=torch.long)
    return table[positions // block_size], positions % block_size


def blocks_covering(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Block ids holding any token of ``[start, end)``."""
    if end <= start:
        return []
    return list(block_ids[start // block_size : (end + block_size - 1) // block_size])


def gather_layer(kv_layer: Any, slots: tuple[Any, Any]) -> Any:
    """Bytes of the given token slots: ``(2, tokens, kv_heads, head_dim * elem)`` uint8,
    on the cache's device."""
    blocks, offsets = slots
    device = kv_layer.device
    return _bytes(kv_layer)[:, blocks.to(device), offsets.to(device)]


def scatter_layer(kv_layer: Any, slots: tuple[Any, Any], src: Any) -> None:
    """Write ``src`` (as :func:`gather_layer` returns it) into the given token slots."""
    blocks, offsets = slots
    device = kv_layer.device
    _bytes(kv_layer)[:, blocks.to(device), offsets.to(device)] = src.to(device)


def tokens_to_chunks(token_major: Any, chunk_size: int) -> Any:
    """``(2, n * chunk_size, H, Db)`` -> ``(n, 2, chunk_size, H, Db)`` (a view)."""
    kv, tokens, heads, width = token_major.shape
    if tokens % chunk_size:
        raise ValueError(f"{tokens} tokens are not whole chunks of {chunk_size}")
    return token_major.view(kv, tokens // chunk_size, chunk_size, heads, width).transpose(0, 1)


def chunks_to_tokens(chunk_major: Any) -> Any:
    """``(n, 2, chunk_size, H, Db)`` -> ``(2, n * chunk_size, H, Db)`` (a copy)."""
    n, kv, chunk, heads, width = chunk_major.shape
    return chunk_major.transpose(0, 1).reshape(kv, n * chunk, heads, width)
