"""The encoded-chunk frame: header, body, checksum.

Layout (little-endian), format version :data:`~.spec.FORMAT_VERSION`::

    magic      4  b"LKVC"
    version    1  frame format version (1)
    mode       1  0 none, 1 lossless, 2 int8, 3 cachegen
    dtype      1  1 bfloat16, 2 float16, 3 float32
    tag_len    1  length of the spec tag
    tag        n  CodecSpec.tag, ASCII (mode, version and parameters)
    shape     20  5 x u32: layers, 2, tokens, kv heads, head dim (the real tokens)
    body_len   8  u64
    body       body_len bytes, mode specific
    crc32c     4  CRC-32C of every byte before it

A frame that is short, long, of another magic, version, mode, tag, dtype or
shape, or whose checksum does not match, raises :class:`CodecError`: the
caller treats it as a miss.

Primitives: :func:`pack`, :func:`unpack`, :class:`Header`, :class:`CodecError`.
"""

from __future__ import annotations

import dataclasses
import struct

from .spec import FORMAT_VERSION

try:
    from crc32c import crc32c as _crc32c
except ImportError:  # pragma: no cover - the `codec` extra installs it
    _crc32c = None  # type: ignore[assignment]

MAGIC = b"LKVC"
_FIXED = struct.Struct("<4sBBBB")
_SHAPE = struct.Struct("<5IQ")
_CRC = struct.Struct("<I")

DTYPE_CODES = {"bfloat16": 1, "float16": 2, "float32": 3}


class CodecError(ValueError):
    """An encoded chunk is corrupt, truncated, of another version, spec or shape."""


def checksum(data: bytes | bytearray | memoryview) -> int:
    """CRC-32C (hardware-accelerated by the ``crc32c`` package, a dependency of the `codec` extra)."""
    if _crc32c is None:
        raise ImportError("the KV codec needs the crc32c package: pip install 'lmcache-client[codec]'")
    return int(_crc32c(data))


@dataclasses.dataclass(frozen=True)
class Header:
    """What a frame says about itself."""

    version: int
    mode_id: int
    dtype_code: int
    tag: str
    shape: tuple[int, int, int, int, int]


def header_bytes(tag: str) -> int:
    """Bytes of a frame around its body (header + checksum) for a spec tag."""
    return _FIXED.size + len(tag.encode("ascii")) + _SHAPE.size + _CRC.size


def pack(
    mode_id: int, dtype_code: int, tag: str, shape: tuple[int, ...], body: bytes | bytearray | memoryview
) -> bytes:
    """One frame around ``body``; returns bytes (one copy of the body)."""
    tag_b = tag.encode("ascii")
    head = _FIXED.pack(MAGIC, FORMAT_VERSION, mode_id, dtype_code, len(tag_b)) + tag_b
    head += _SHAPE.pack(*shape, len(body))
    out = bytearray(len(head) + len(body) + _CRC.size)
    out[: len(head)] = head
    end = len(head) + len(body)
    out[len(head) : end] = body
    view = memoryview(out)
    _CRC.pack_into(out, end, checksum(view[:end]))
    return bytes(out)


def unpack(buf: bytes | bytearray | memoryview) -> tuple[Header, memoryview]:
    """Check a frame and return its header and a view of its body; raises CodecError."""
    view = memoryview(buf).cast("B")
    if len(view) < _FIXED.size + _SHAPE.size + _CRC.size:
        raise CodecError(f"encoded chunk truncated: {len(view)} bytes is shorter than any frame")
    magic, version, mode_id, dtype_code, tag_len = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise CodecError(f"not an encoded KV chunk (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise CodecError(f"encoded chunk has format version {version}; this client reads {FORMAT_VERSION}")
    pos = _FIXED.size + tag_len
    if len(view) < pos + _SHAPE.size + _CRC.size:
        raise CodecError("encoded chunk truncated inside its header")
    try:
        tag = bytes(view[_FIXED.size : pos]).decode("ascii")
    except UnicodeDecodeError as err:
        raise CodecError("encoded chunk has a corrupt spec tag") from err
    *shape, body_len = _SHAPE.unpack_from(view, pos)
    pos += _SHAPE.size
    if pos + body_len + _CRC.size != len(view):
        promised = pos + body_len + _CRC.size
        raise CodecError(f"encoded chunk is {len(view)} bytes; its header promises {promised} (truncated or padded)")
    end = pos + body_len
    (stored,) = _CRC.unpack_from(view, end)
    if checksum(view[:end]) != stored:
        raise CodecError("encoded chunk fails its checksum (corrupt)")
    dims = (shape[0], shape[1], shape[2], shape[3], shape[4])
    return Header(version, mode_id, dtype_code, tag, dims), view[pos:end]
