"""Entropy coding of quantized symbols for the ``cachegen`` mode.

Symbols are small signed integers (int32 tensors).  When all are in
-128..127 (the usual case) they are stored as ``s + 128``, one byte plane;
else zigzag-mapped (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...) as a low and a high
plane (the high one almost all zero).  The planes are compressed with zstd
(:mod:`.planes`), whose Huffman stage codes each 128 KiB block near its
order-0 entropy.  :func:`entropy_bits` estimates that cost from histograms,
for rate control.

Primitives: :func:`zigzag`, :func:`unzigzag`, :func:`encode_symbols`,
:func:`decode_symbols`, :func:`entropy_bits`.
"""

from __future__ import annotations

import torch

from .base import bytes_tensor
from .frame import CodecError
from .planes import max_packed_bytes, pack_planes, plane_count, symbol_compressor, unpack_planes

MAX_SYMBOL = 32767


def zigzag(s: torch.Tensor) -> torch.Tensor:
    """Signed int32 symbols -> non-negative int32 (0, -1, 1, -2 -> 0, 1, 2, 3)."""
    return (s << 1) ^ (s >> 31)


def unzigzag(z: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`zigzag` (any signed integer dtype that holds the values)."""
    return (z >> 1) ^ -(z & 1)


def entropy_bits(symbols: torch.Tensor, groups: int) -> float:
    """Estimated coded bits of ``symbols`` (int32, leading dim split into ``groups`` equal parts,
    each coded with its own order-0 statistics), from zigzag histograms clamped at 256."""
    z = zigzag(symbols.reshape(groups, -1)).clamp_(max=255)
    offsets = torch.arange(groups, device=z.device, dtype=torch.int64)[:, None] * 256
    counts = torch.bincount((z + offsets).reshape(-1), minlength=groups * 256).view(groups, 256).double()
    total = counts.sum(dim=1, keepdim=True)
    p = counts / total
    bits = -(counts * torch.where(p > 0, p.log2(), torch.zeros_like(p))).sum()
    return float(bits)


NARROW_OFFSET = 128
"""Narrow symbols (all in -128..127) are stored as ``s + 128`` bytes: decoding folds the offset
into its one multiply-add, with no per-element integer work."""


def encode_symbols(symbols: torch.Tensor, groups: int) -> bytes:
    """Symbols (int32, |s| <= MAX_SYMBOL, leading dim split into ``groups`` equal segments) ->
    a planes container: one byte plane per segment (``s + 128``) when every symbol is in
    -128..127, else a low and a high plane per segment of the zigzag-mapped symbols.  Each
    segment (one layer's K or V) is its own zstd frame, so Huffman tables follow that
    segment's distribution."""
    s = symbols.reshape(groups, -1)
    if int(s.min()) >= -NARROW_OFFSET and int(s.max()) < NARROW_OFFSET:
        planes = list((s + NARROW_OFFSET).to(torch.uint8).cpu())
    else:
        z = zigzag(s)
        planes = list((z & 0xFF).to(torch.uint8).cpu()) + list((z >> 8).to(torch.uint8).cpu())
    return pack_planes(planes, always=tuple(range(len(planes))), comp=symbol_compressor())


def max_symbol_bytes(count: int, groups: int) -> int:
    """Upper bound of :func:`encode_symbols` for ``count`` symbols in ``groups`` segments."""
    return max_packed_bytes([count // groups] * (2 * groups))


def decode_symbols(body: memoryview, count: int, groups: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Inverse of :func:`encode_symbols`: (``count`` stored symbols on ``device``, offset), the
    symbols being ``stored - offset``: uint8 with offset 128 (narrow) or int32 with offset 0."""
    planes_n = plane_count(body)
    if planes_n not in (groups, 2 * groups):
        raise CodecError(f"cachegen symbols have {planes_n} planes, expected {groups} or {2 * groups}")
    seg = count // groups
    planes = unpack_planes(body, [seg] * planes_n)
    if planes_n == groups:
        z = torch.empty(groups, seg, dtype=torch.uint8)
        for g in range(groups):
            z[g] = bytes_tensor(planes[g])
        return z.reshape(-1).to(device), NARROW_OFFSET
    w = torch.empty(groups, seg, dtype=torch.int32)
    for g in range(groups):
        w[g] = bytes_tensor(planes[g])
        w[g] |= bytes_tensor(planes[groups + g]).to(torch.int32) << 8
    return unzigzag(w.reshape(-1)).to(device), 0
