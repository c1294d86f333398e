"""Mode ``int8``: grouped asymmetric quantization with float16 scales.

Each run of ``group`` consecutive elements along (kv heads x head dim) of one
token gets a minimum ``m`` and a step ``s`` (both float16, ``m`` rounded down
and ``s`` rounded up, so every element is in range) and is stored as
``bits``-bit codes ``q = round((x - m) / s)``, ``0 <= q <= 2**bits - 1``;
decoding gives ``m + q * s``.  Per element ``|x - x'| <= s / 2`` (then the
cast back to the chunk dtype rounds once more: bfloat16 by ``|x'| * 2**-9``).
``bits`` 8 is the int8 mode proper; 4 and 2 are the plain baselines the
CacheGen-style mode is measured against (4 bits in groups of 32 store
4 + 32/32 = 5 bits per element, 3.2x smaller than bfloat16).

Body: float16 minimums (one per group), float16 steps, then the packed codes
(little-endian, lowest code in the lowest bits).  Lossy modes need finite
values within float16 range (|x| < 65504); encode refuses others.

Primitives: :func:`quantize_groups`, :func:`dequantize_groups`,
:func:`pack_codes`, :func:`unpack_codes`, :class:`GroupQuantCodec`.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Codec, Shape5, bytes_tensor, tensor_bytes
from .frame import CodecError
from .spec import CodecSpec

_FP16_MAX = 65504.0


def round_half(x: torch.Tensor, up: bool) -> torch.Tensor:
    """``x`` (float32) in float16, rounded up (or down) so it is >= (or <=) ``x``."""
    h = x.to(torch.float16)
    hf = h.float()
    wrong = hf < x if up else hf > x
    bound = torch.full_like(h, float("inf") if up else float("-inf"))
    return torch.where(wrong, torch.nextafter(h, bound), h)


def check_range(lo: torch.Tensor, hi: torch.Tensor) -> None:
    """Refuse values the lossy modes cannot hold (non-finite, or beyond float16 range)."""
    worst = torch.maximum(hi.abs(), lo.abs()).max()
    if not bool(torch.isfinite(worst)) or float(worst) > _FP16_MAX / 2:
        raise ValueError(f"lossy KV codec needs finite values within +-{_FP16_MAX / 2:g}; chunk has {float(worst)}")


def quantize_groups(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` (groups, group) float32 -> (codes uint8, minimums fp16, steps fp16)."""
    levels = (1 << bits) - 1
    lo = x.amin(dim=1)
    hi = x.amax(dim=1)
    check_range(lo, hi)
    mins = round_half(lo, up=False)
    steps = round_half((hi - mins.float()) / levels, up=True)
    # the float16 step, times levels, must reach the maximum (float32 arithmetic as in decode)
    short = mins.float() + steps.float() * levels < hi
    steps = torch.where(short, torch.nextafter(steps, torch.full_like(steps, float("inf"))), steps)
    sf = steps.float()
    safe = torch.where(sf > 0, sf, torch.ones_like(sf))
    codes = torch.round((x - mins.float()[:, None]) / safe[:, None]).clamp_(0, levels).to(torch.uint8)
    return codes, mins, steps


def dequantize_groups(codes: torch.Tensor, mins: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_groups`, float32 (groups, group)."""
    return torch.addcmul(mins.float()[:, None], codes.float(), steps.float()[:, None])


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes of ``bits`` (2, 4 or 8) each -> packed uint8, ``8 // bits`` codes per byte."""
    if bits == 8:
        return codes.reshape(-1)
    per = 8 // bits
    c = codes.reshape(-1, per).to(torch.int32)
    shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.int32)
    return (c << shifts).sum(dim=1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``count`` uint8 codes."""
    if bits == 8:
        return packed[:count]
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
    mask = (1 << bits) - 1
    return ((packed[:, None] >> shifts) & mask).reshape(-1)[:count]


class GroupQuantCodec(Codec):
    """Grouped ``bits``-bit quantization (8 = int8), groups of ``group`` along heads x head dim."""

    def __init__(self, spec: CodecSpec, shape: Shape5, dtype: Any) -> None:
        super().__init__(spec, shape, dtype)
        self.group = int(spec.get("group"))
        self.bits = int(spec.get("bits"))
        if (self.shape[3] * self.shape[4]) % self.group:
            raise ValueError(
                f"int8 group {self.group} must divide kv_heads x head_dim = {self.shape[3] * self.shape[4]}"
            )

    def _counts(self, tokens: int) -> tuple[int, int]:
        elements = self.raw_bytes(tokens) // self.element_bytes
        return elements, elements // self.group

    def _max_body_bytes(self, tokens: int) -> int:
        elements, groups = self._counts(tokens)
        return groups * 4 + elements * self.bits // 8

    def _encode_body(self, chunk: torch.Tensor) -> bytes:
        x = chunk.detach().reshape(-1, self.group).float()
        codes, mins, steps = quantize_groups(x, self.bits)
        parts = [mins.cpu(), steps.cpu(), pack_codes(codes, self.bits).cpu()]
        return b"".join(tensor_bytes(p) for p in parts)

    def _decode_body(self, body: memoryview, tokens: int, device: torch.device) -> torch.Tensor:
        elements, groups = self._counts(tokens)
        data = bytes_tensor(body, self._max_body_bytes(tokens)).to(device)
        mins = data[: 2 * groups].view(torch.float16)
        steps = data[2 * groups : 4 * groups].view(torch.float16)
        codes = unpack_codes(data[4 * groups :], self.bits, elements).view(groups, self.group)
        if not bool(torch.isfinite(steps).all()) or not bool(torch.isfinite(mins).all()):
            raise CodecError("int8 body has non-finite scales")
        x = dequantize_groups(codes, mins, steps)
        return x.view(*self.shape[:2], tokens, *self.shape[3:])
