"""The checksummed chunk record shared by every tier below memory (disk files, Redis values).

Layout (all integers little-endian)::

    0   4  magic            b"LMKV"
    4   2  format version   1
    6   2  namespace length N (UTF-8 bytes)
    8   4  header length    H: offset of the payload (>= 64 + N; disk pads it to 4096)
    12  8  payload length   L
    20  4  payload CRC32C
    24  32 key
    56  4  header CRC32C    over bytes [0, 56) and the namespace
    60  4  reserved (0)
    64  N  namespace
    ..     zero padding up to H
    H   L  payload

A record is served only if the magic, version, both checksums, the namespace
and the key all match what was asked for; anything else is a miss (and the
record is discarded), never wrong bytes.

Primitives: :func:`encode_header`, :func:`encode_record`, :func:`parse_header`
(raises CorruptRecord), :func:`verify_payload`, :func:`decode_record`, :func:`checksum`.
Each of them may run in a worker thread (see :mod:`.offload`): the checksums and
the copy release the GIL on large buffers.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import crc32c

from .offload import memcopy, raw_buffer

MAGIC = b"LMKV"
FORMAT_VERSION = 1
FIXED_BYTES = 64
_FIXED = struct.Struct("<4sHHIQI32s")  # through the key: 56 bytes
_TAIL = struct.Struct("<II")  # header crc, reserved


class CorruptRecord(ValueError):
    """A record that must not be served: truncated, damaged, foreign or misfiled."""


def checksum(data: Any) -> int:
    """CRC32C (Castagnoli), hardware-accelerated; releases the GIL on large buffers."""
    return int(crc32c.crc32c(data))


@dataclasses.dataclass(frozen=True)
class RecordHeader:
    namespace: str
    key: bytes
    header_len: int
    payload_len: int
    payload_crc: int


def encode_header(namespace: str, key: bytes, payload: Any, pad_to: int = 0) -> bytes:
    """The header of a record holding ``payload`` (its checksum is computed here)."""
    ns = namespace.encode()
    header_len = max(FIXED_BYTES + len(ns), pad_to)
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, len(ns), header_len, memoryview(payload).nbytes, checksum(payload), key)
    head_crc = checksum(fixed + ns)
    out = fixed + _TAIL.pack(head_crc, 0) + ns
    return out + bytes(header_len - len(out))


def parse_header(buf: Any) -> RecordHeader:
    """Parse and check a record header (the first bytes of a record)."""
    view = memoryview(buf)
    if view.nbytes < FIXED_BYTES:
        raise CorruptRecord(f"record shorter than its fixed header ({view.nbytes} bytes)")
    magic, version, ns_len, header_len, payload_len, payload_crc, key = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise CorruptRecord("not an lmcache record (bad magic)")
    if version != FORMAT_VERSION:
        raise CorruptRecord(f"record format version {version}, this server reads {FORMAT_VERSION}")
    head_crc, _ = _TAIL.unpack_from(view, _FIXED.size)
    if header_len < FIXED_BYTES + ns_len or view.nbytes < FIXED_BYTES + ns_len:
        raise CorruptRecord("record header truncated")
    ns = bytes(view[FIXED_BYTES : FIXED_BYTES + ns_len])
    if checksum(bytes(view[: _FIXED.size]) + ns) != head_crc:
        raise CorruptRecord("record header checksum mismatch")
    try:
        namespace = ns.decode()
    except UnicodeDecodeError:
        raise CorruptRecord("record namespace is not UTF-8") from None
    return RecordHeader(namespace, key, header_len, payload_len, payload_crc)


def verify_payload(header: RecordHeader, payload: Any, namespace: str, key: bytes) -> None:
    """Raise CorruptRecord unless ``payload`` is exactly what ``header`` describes for (namespace, key)."""
    if header.namespace != namespace or header.key != key:
        raise CorruptRecord("record belongs to another key or namespace")
    if memoryview(payload).nbytes != header.payload_len:
        raise CorruptRecord(f"payload is {memoryview(payload).nbytes} bytes, header says {header.payload_len}")
    if checksum(payload) != header.payload_crc:
        raise CorruptRecord("payload checksum mismatch")


def encode_record(namespace: str, key: bytes, payload: Any) -> memoryview:
    """A whole record (header, then a copy of ``payload``) in one new buffer
    (not zeroed first: see :func:`.offload.raw_buffer`)."""
    source = memoryview(payload).cast("B")
    header = encode_header(namespace, key, source)
    record = raw_buffer(len(header) + source.nbytes)
    record[: len(header)] = header
    memcopy(record[len(header) :], source)
    return record


def decode_record(record: Any, namespace: str, key: bytes) -> memoryview:
    """The payload of a whole record, after every check (raises CorruptRecord)."""
    if not isinstance(record, (bytes, bytearray, memoryview)):
        raise CorruptRecord(f"record is a {type(record).__name__}, not bytes")
    header = parse_header(record)
    payload = memoryview(record)[header.header_len :]
    verify_payload(header, payload, namespace, key)
    return payload
