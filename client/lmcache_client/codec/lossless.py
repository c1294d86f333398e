"""Mode ``lossless``: exact bytes, byte planes then zstd.

The chunk's elements are split into byte planes (for bfloat16: all low
bytes, then all high bytes), on the chunk's own device.  The top plane (sign
and exponent) takes few distinct values and compresses well with zstd; the
mantissa planes are close to random and are stored raw unless a sample
shows zstd gains (:mod:`.planes`).  Body: a :mod:`.planes` container; in
chunks of 1 Mi elements or more each plane is cut in 4 segments (plane 0
segments first), so the zstd frames decode in parallel.

Primitive: :class:`LosslessCodec`.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Codec, Shape5, bytes_tensor
from .planes import max_packed_bytes, need_zstd, pack_planes, unpack_planes
from .spec import CodecSpec

SEGMENTS = 4
SEGMENT_MIN = 1 << 20
"""Elements from which each byte plane is split into SEGMENTS zstd frames."""


class LosslessCodec(Codec):
    """Byte planes + zstd; decodes to the identical bytes (NaN payloads, -0.0 included)."""

    def __init__(self, spec: CodecSpec, shape: Shape5, dtype: Any) -> None:
        super().__init__(spec, shape, dtype)
        need_zstd()
        self.level = int(spec.get("level"))

    def _segments(self, elements: int) -> list[int]:
        """Each byte plane is cut into segments (zstd frames decoded in parallel), 4 for large chunks."""
        count = SEGMENTS if elements >= SEGMENT_MIN else 1
        return [elements // count + (1 if j < elements % count else 0) for j in range(count)]

    def _max_body_bytes(self, tokens: int) -> int:
        elements = self.raw_bytes(tokens) // self.element_bytes
        return max_packed_bytes(self._segments(elements) * self.element_bytes)

    def _encode_body(self, chunk: torch.Tensor) -> bytes:
        u = chunk.detach().reshape(-1).view(torch.uint8).view(-1, self.element_bytes)
        segs = self._segments(u.shape[0])
        planes = [p.contiguous().cpu() for i in range(self.element_bytes) for p in torch.split(u[:, i], segs)]
        top = range((self.element_bytes - 1) * len(segs), self.element_bytes * len(segs))
        return pack_planes(planes, self.level, always=tuple(top))

    def _decode_body(self, body: memoryview, tokens: int, device: torch.device) -> torch.Tensor:
        elements = self.raw_bytes(tokens) // self.element_bytes
        segs = self._segments(elements)
        planes = unpack_planes(body, segs * self.element_bytes)
        u = torch.empty(elements, self.element_bytes, dtype=torch.uint8)
        for i in range(self.element_bytes):
            for col, data in zip(torch.split(u[:, i], segs), planes[i * len(segs) : (i + 1) * len(segs)]):
                col.copy_(bytes_tensor(data))
        shape = (*self.shape[:2], tokens, *self.shape[3:])
        return u.view(self.dtype).view(shape).to(device)
