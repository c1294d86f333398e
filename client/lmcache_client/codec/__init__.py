"""KV codec: encode chunks where the KV lives, so every tier holds more tokens.

Modes (see docs/codec.md): ``none`` (raw bytes), ``lossless`` (byte shuffle +
zstd, exact), ``int8`` (grouped quantization with scales; ``bits`` 8, 4 or 2),
``cachegen`` (anchor/delta quantization with per-layer bit allocation and
entropy coding).  The codec's :attr:`CodecSpec.tag` is part of the namespace,
so encoded and raw chunks never mix.  Every encoded frame carries a format
version byte and a checksum; a bad frame raises :class:`CodecError` (a miss).

Primitives: :class:`CodecSpec`, :func:`make_codec`, :class:`Codec`,
:class:`CodecError`, :data:`FORMAT_VERSION`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .frame import CodecError
from .spec import FORMAT_VERSION, MODES, CodecSpec

if TYPE_CHECKING:
    from .base import Codec

__all__ = ["FORMAT_VERSION", "MODES", "Codec", "CodecError", "CodecSpec", "make_codec"]


def __getattr__(name: str) -> Any:
    """``Codec`` on first use: the codecs need torch, the spec (what the daemon
    validates its ``kv_codec`` setting with, installed without torch) does not."""
    if name == "Codec":
        from .base import Codec

        return Codec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_codec(spec: CodecSpec | str, shape: tuple[int, int, int, int, int], dtype: Any) -> Codec:
    """The codec for ``spec`` and chunks of ``shape`` (layers, 2, chunk tokens, kv heads, head dim) and ``dtype``."""
    if isinstance(spec, str):
        spec = CodecSpec.parse(spec)
    if spec.mode == "none":
        from .base import NoneCodec

        return NoneCodec(spec, shape, dtype)
    if spec.mode == "lossless":
        from .lossless import LosslessCodec

        return LosslessCodec(spec, shape, dtype)
    if spec.mode == "int8":
        from .quant import GroupQuantCodec

        return GroupQuantCodec(spec, shape, dtype)
    if spec.mode == "cachegen":
        from .cachegen import CacheGenCodec

        return CacheGenCodec(spec, shape, dtype)
    raise ValueError(f"unknown codec mode {spec.mode!r}")  # unreachable: CodecSpec validates
