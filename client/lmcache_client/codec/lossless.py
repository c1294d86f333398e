"""Mode ``lossless``: exact bytes, byte-shuffled then zstd.

The chunk's elements are split into byte planes (for bfloat16: all low bytes,
then all high bytes), on the chunk's own device, and the planes are
compressed with zstd.  The high byte of a bfloat16/float16 KV element (sign
and exponent) takes few distinct values and compresses well; the mantissa
bytes are close to random, and zstd stores such blocks raw at memcpy-like
speed.  Body: one zstd frame of the shuffled bytes (its content size set).

Primitive: :class:`LosslessCodec`.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Codec, Shape5, bytes_tensor, tensor_bytes
from .frame import CodecError
from .spec import CodecSpec

try:
    import zstandard
except ImportError:  # pragma: no cover - the `codec` extra installs it
    zstandard = None


def need_zstd() -> Any:
    if zstandard is None:
        raise ImportError("KV codec modes lossless and cachegen need zstandard: pip install 'lmcache-client[codec]'")
    return zstandard


def shuffle(chunk: torch.Tensor) -> torch.Tensor:
    """Byte planes of ``chunk`` (on its device): shape (element bytes, elements), uint8."""
    esize = chunk.element_size()
    return chunk.reshape(-1).view(torch.uint8).view(-1, esize).t().contiguous()


def unshuffle(planes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`shuffle`: a flat tensor of ``dtype``."""
    return planes.t().contiguous().view(dtype).reshape(-1)


class LosslessCodec(Codec):
    """Byte shuffle + zstd; decodes to the identical bytes (NaN payloads, -0.0 included)."""

    def __init__(self, spec: CodecSpec, shape: Shape5, dtype: Any) -> None:
        super().__init__(spec, shape, dtype)
        zstd = need_zstd()
        self._compressor = zstd.ZstdCompressor(level=int(spec.get("level")), write_content_size=True)
        self._decompressor = zstd.ZstdDecompressor()

    def _max_body_bytes(self, tokens: int) -> int:
        raw = self.raw_bytes(tokens)
        # zstd's documented worst case (ZSTD_compressBound) plus its frame header
        return raw + (raw >> 8) + 64

    def _encode_body(self, chunk: torch.Tensor) -> bytes:
        planes = shuffle(chunk.detach()).cpu()
        return self._compressor.compress(tensor_bytes(planes))

    def _decode_body(self, body: memoryview, tokens: int, device: torch.device) -> torch.Tensor:
        raw = self.raw_bytes(tokens)
        try:
            data = self._decompressor.decompress(body, max_output_size=raw)
        except zstandard.ZstdError as err:
            raise CodecError(f"lossless body does not decompress: {err}") from err
        planes = bytes_tensor(data, raw).view(self.element_bytes, -1).to(device)
        shape = (*self.shape[:2], tokens, *self.shape[3:])
        return unshuffle(planes, self.dtype).view(shape)
