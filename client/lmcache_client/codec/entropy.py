"""Entropy coding of quantized symbols for the ``cachegen`` mode.

Symbols are small signed integers (int32 tensors).  They are zigzag-mapped
(0, -1, 1, -2, ... -> 0, 1, 2, 3, ...); when every mapped symbol fits a byte
(the usual case) they are one byte plane, else a low and a high plane (the
high one almost all zero); the planes are compressed with zstd
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


def encode_symbols(symbols: torch.Tensor, groups: int) -> bytes:
    """Symbols (int32, |s| <= MAX_SYMBOL, leading dim split into ``groups`` equal segments) ->
    a planes container: one byte plane per segment, or a low and a high plane per segment when
    some symbol needs more than 8 bits.  Each segment (one layer's K or V) is its own zstd frame,
    so Huffman tables follow that segment's distribution."""
    z = zigzag(symbols.reshape(groups, -1))
    if int(z.max()) < 256:
        planes = list(z.to(torch.uint8).cpu())
    else:
        planes = list((z & 0xFF).to(torch.uint8).cpu()) + list((z >> 8).to(torch.uint8).cpu())
    return pack_planes(planes, always=tuple(range(len(planes))), comp=symbol_compressor())


def max_symbol_bytes(count: int, groups: int) -> int:
    """Upper bound of :func:`encode_symbols` for ``count`` symbols in ``groups`` segments."""
    return max_packed_bytes([count // groups] * (2 * groups))


def decode_symbols(body: memoryview, count: int, groups: int, device: torch.device) -> torch.Tensor:
    """Inverse of :func:`encode_symbols`: ``count`` int16 or int32 symbols on ``device``."""
    planes_n = plane_count(body)
    if planes_n not in (groups, 2 * groups):
        raise CodecError(f"cachegen symbols have {planes_n} planes, expected {groups} or {2 * groups}")
    seg = count // groups
    planes = unpack_planes(body, [seg] * planes_n)
    wide = planes_n == 2 * groups
    # int16 is enough for one plane per segment (the usual case) and half the memory traffic
    z = torch.empty(groups, seg, dtype=torch.int32 if wide else torch.int16)
    for g in range(groups):
        z[g] = bytes_tensor(planes[g])  # the widening copy
        if wide:
            z[g] |= bytes_tensor(planes[groups + g]).to(torch.int32) << 8
    return unzigzag(z.reshape(-1).to(device))
