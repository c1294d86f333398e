"""Byte planes, each stored raw or as a zstd frame: the container both the
``lossless`` and the ``cachegen`` bodies are made of.

Container: ``u16`` plane count, then per plane ``u8`` method (0 raw, 1 zstd)
and ``u64`` stored length, then the planes' bytes in order.  Every plane
decodes to a length the codec knows from the frame's shape, and any other
length is a :class:`CodecError`.  zstd is tried on a sample first, so a
near-random plane (mantissa bytes) costs a memcpy, not a compression pass.

A zstd frame is never trusted with its own size: python-zstandard allocates
the content size a frame declares (ignoring ``max_output_size``), so a few KiB
can declare gigabytes.  The declared size must be the plane's expected size
before anything is decompressed, and a frame that declares none is decoded
into at most that many bytes.

Primitives: :func:`pack_planes`, :func:`unpack_planes`, :func:`plane_count`,
:func:`symbol_compressor`, :func:`need_zstd`.
"""

from __future__ import annotations

import struct
from typing import Any

import torch

from .frame import CodecError

try:
    import zstandard
except ImportError:  # pragma: no cover - the `codec` extra installs it
    zstandard = None  # type: ignore[assignment]

_COUNT = struct.Struct("<H")
_ENTRY = struct.Struct("<BQ")
RAW, ZSTD = 0, 1
_SAMPLE = 1 << 16


def need_zstd() -> Any:
    if zstandard is None:
        raise ImportError("KV codec modes lossless and cachegen need zstandard: pip install 'lmcache-client[codec]'")
    return zstandard


def symbol_compressor() -> Any:
    """zstd for entropy-coded symbols: level 1 with matches of at least 7 bytes, so random short
    repeats do not become match sequences and the Huffman literal coder does the work."""
    zstd = need_zstd()
    params = zstd.ZstdCompressionParameters(compression_level=1, min_match=7, write_content_size=True)
    return zstd.ZstdCompressor(compression_params=params)


def pack_planes(planes: list[torch.Tensor], level: int = 1, always: tuple[int, ...] = (), comp: Any = None) -> bytes:
    """uint8 CPU tensors -> container bytes; planes in ``always`` are compressed without a sample test.

    ``comp``: a zstandard compressor to use instead of one of ``level``."""
    zstd = need_zstd()
    comp = comp or zstd.ZstdCompressor(level=level, write_content_size=True)
    entries, datas = [], []
    for i, plane in enumerate(planes):
        raw = memoryview(plane.contiguous().numpy())  # type: ignore[arg-type]
        method, data = RAW, raw
        if len(raw) and (i in always or len(comp.compress(raw[:_SAMPLE])) < 0.9 * min(len(raw), _SAMPLE)):
            packed = comp.compress(raw)
            if len(packed) < len(raw):
                method, data = ZSTD, packed
        entries.append(_ENTRY.pack(method, len(data)))
        datas.append(data)
    return b"".join([_COUNT.pack(len(planes)), *entries, *datas])


def max_packed_bytes(sizes: list[int]) -> int:
    """Upper bound of :func:`pack_planes` for planes of these sizes."""
    return _COUNT.size + len(sizes) * _ENTRY.size + sum(sizes)


def unpack_planes(body: memoryview, sizes: list[int]) -> list[Any]:
    """Inverse of :func:`pack_planes`; ``sizes`` are the decoded plane lengths the frame's shape implies.

    Returns bytes-likes; with torch threads > 1, several zstd planes decompress in parallel."""
    zstd = need_zstd()
    count = _COUNT.unpack_from(body, 0)[0] if len(body) >= _COUNT.size else 0
    if count != len(sizes):
        raise CodecError(f"encoded body has {count} byte planes, expected {len(sizes)}")
    pos = _COUNT.size
    if len(body) < pos + len(sizes) * _ENTRY.size:
        raise CodecError("encoded body truncated in its plane table")
    entries = [_ENTRY.unpack_from(body, pos + i * _ENTRY.size) for i in range(len(sizes))]
    pos += len(sizes) * _ENTRY.size
    if pos + sum(length for _, length in entries) != len(body):
        raise CodecError("encoded body's planes do not add up to its length")
    out: list[Any] = []
    packed: list[tuple[int, memoryview, int]] = []  # (index, frame, decoded size)
    for i, ((method, length), size) in enumerate(zip(entries, sizes)):
        data = body[pos : pos + length]
        pos += length
        if method == ZSTD:
            packed.append((i, data, size))
        elif method != RAW:
            raise CodecError(f"encoded plane has unknown method {method}")
        out.append(data)
    dec = zstd.ZstdDecompressor()
    threads = torch.get_num_threads()
    try:
        for _, f, size in packed:
            _check_declared_size(zstd, f, size)
        if len(packed) > 1 and threads > 1:  # frames in parallel, on torch's thread count
            decoded = dec.multi_decompress_to_buffer(
                [f for _, f, _ in packed],
                decompressed_sizes=struct.pack(f"<{len(packed)}Q", *(s for _, _, s in packed)),
                threads=min(threads, len(packed)),
            )
            for k, (i, _, _) in enumerate(packed):
                out[i] = decoded[k]
        else:
            for i, f, size in packed:
                out[i] = dec.decompress(f, max_output_size=size)
    except zstd.ZstdError as err:
        raise CodecError(f"encoded plane does not decompress: {err}") from err
    for data, size in zip(out, sizes):
        if len(memoryview(data)) != size:
            raise CodecError(f"encoded plane decodes to {len(memoryview(data))} bytes, expected {size}")
    return out


def _check_declared_size(zstd: Any, data: memoryview, size: int) -> None:
    """Refuse a zstd frame that declares a content size other than ``size`` (before
    it is decompressed: the decompressor would allocate what it declares).  A frame
    that declares none is bounded by ``max_output_size``, which must then be > 0."""
    declared = zstd.frame_content_size(data)
    if declared == -1 and size > 0:
        return
    if declared != size or size == 0:
        raise CodecError(f"encoded plane declares {declared} bytes, expected {size}")


def plane_count(body: memoryview) -> int:
    """The plane count a container says it has (0 when too short to say)."""
    return int(_COUNT.unpack_from(body, 0)[0]) if len(body) >= _COUNT.size else 0
