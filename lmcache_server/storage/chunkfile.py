"""The checksummed chunk record shared by every tier below memory (disk files, Redis values).

Layout (all integers little-endian)::

    0   4  magic            b"LMKV"
    4   2  format version   1 (no token ids) or 2 (token ids follow the namespace)
    6   2  namespace length N (UTF-8 bytes)
    8   4  header length    H: offset of the payload (>= 64 + N [+ 32 + 4T]; disk pads it
                            to a multiple of 4096)
    12  8  payload length   L
    20  4  payload CRC32C
    24  32 key
    56  4  header CRC32C    over bytes [0, 56), the namespace and (version 2) bytes
                            [60, 64) and the token section
    60  4  token count T    (version 2; version 1: reserved, 0)
    64  N  namespace
    ..  32 parent key       (version 2 only: the key of the chunk before it)
    ..  4T token ids, u32le (version 2 only)
    ..     zero padding up to H
    H   L  payload

A record is served only if the magic, version, both checksums, the namespace
and the key all match what was asked for; anything else is a miss (and the
record is discarded), never wrong bytes.  A version 2 record's token ids must
also hash to its key (``chain_key(parent, ids)``, as a put's are checked,
server/tokens.py), else the record is damaged: the ids a node announces for a
key (KV events) are always the ones the key was computed from.

Token ids are written when the tier knows them (a chunk put with token ids
while KV events are on), so that a node that finds the record later (a disk
scan after a crash, a promotion from Redis of another node's chunk) can
announce it (docs/events.md).  A record without them is written as version 1,
byte for byte as before; a daemon that reads only version 1 takes a version 2
record for a miss.

Primitives: :func:`encode_header`, :func:`encode_record`, :func:`header_length`,
:func:`parse_header` (raises CorruptRecord), :func:`verify_payload`,
:func:`decode_record`, :func:`checksum`.
Each of them may run in a worker thread (see :mod:`.offload`): the checksums and
the copy release the GIL on large buffers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from typing import Any

import crc32c

from lmcache_client.keys import KEY_DOMAIN, ChunkTokens

from .offload import memcopy, raw_buffer

MAGIC = b"LMKV"
FORMAT_VERSION = 1
"""Records without token ids."""
TOKENS_VERSION = 2
"""Records with token ids (after the namespace)."""
FIXED_BYTES = 64
KEY_BYTES = 32
MAX_TOKENS = 1 << 20
"""Token ids one record may carry (a header claiming more is damaged)."""
MAX_HEADER = FIXED_BYTES + 0xFFFF + KEY_BYTES + 4 * MAX_TOKENS + 4096
"""The longest header a record may claim (namespace, token section, padding)."""
_FIXED = struct.Struct("<4sHHIQI32s")  # through the key: 56 bytes
_TAIL = struct.Struct("<II")  # header crc, token count (version 1: reserved, 0)


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
    tokens: ChunkTokens | None = None
    """The chunk's token ids and parent key (version 2), checked against its key."""


def encode_header(
    namespace: str, key: bytes, payload: Any, pad_to: int = 0, tokens: ChunkTokens | None = None
) -> bytes:
    """The header of a record holding ``payload`` (its checksum is computed here),
    with ``tokens`` when given (version 2), padded to a multiple of ``pad_to``."""
    ns = namespace.encode()
    section = b"" if tokens is None else tokens.parent + tokens.packed
    need = FIXED_BYTES + len(ns) + len(section)
    header_len = -(-need // pad_to) * pad_to if pad_to else need
    version, count = (FORMAT_VERSION, 0) if tokens is None else (TOKENS_VERSION, len(tokens.packed) // 4)
    fixed = _FIXED.pack(MAGIC, version, len(ns), header_len, memoryview(payload).nbytes, checksum(payload), key)
    counted = b"" if tokens is None else count.to_bytes(4, "little")
    head_crc = checksum(fixed + ns + counted + section)
    out = fixed + _TAIL.pack(head_crc, count) + ns + section
    return out + bytes(header_len - len(out))


def header_length(buf: Any) -> int:
    """The header length a record's first :data:`FIXED_BYTES` claim (unchecked beyond
    the magic and version: :func:`parse_header` checks the rest), so a reader knows
    how much to read before parsing."""
    view = memoryview(buf)
    if view.nbytes < FIXED_BYTES:
        raise CorruptRecord(f"record shorter than its fixed header ({view.nbytes} bytes)")
    magic, version, ns_len, header_len, *_ = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise CorruptRecord("not an lmcache record (bad magic)")
    if version not in (FORMAT_VERSION, TOKENS_VERSION):
        raise CorruptRecord(f"record format version {version}, this server reads {FORMAT_VERSION} and {TOKENS_VERSION}")
    if header_len > MAX_HEADER:
        raise CorruptRecord(f"record header of {header_len} bytes")
    return int(header_len)


def parse_header(buf: Any) -> RecordHeader:
    """Parse and check a record header (the first bytes of a record, through its token
    section: the first :func:`header_length` bytes hold it)."""
    view = memoryview(buf)
    header_length(view)
    magic, version, ns_len, header_len, payload_len, payload_crc, key = _FIXED.unpack_from(view)
    head_crc, count = _TAIL.unpack_from(view, _FIXED.size)
    if version == FORMAT_VERSION:
        count = 0
    elif not 0 < count <= MAX_TOKENS:
        raise CorruptRecord(f"record claims {count} token ids")
    section_len = KEY_BYTES + 4 * count if count else 0
    end = FIXED_BYTES + ns_len + section_len
    if header_len < end or view.nbytes < end:
        raise CorruptRecord("record header truncated")
    ns = bytes(view[FIXED_BYTES : FIXED_BYTES + ns_len])
    section = bytes(view[FIXED_BYTES + ns_len : end])
    counted = b"" if version == FORMAT_VERSION else bytes(view[_FIXED.size + 4 : FIXED_BYTES])
    if checksum(bytes(view[: _FIXED.size]) + ns + counted + section) != head_crc:
        raise CorruptRecord("record header checksum mismatch")
    try:
        namespace = ns.decode()
    except UnicodeDecodeError:
        raise CorruptRecord("record namespace is not UTF-8") from None
    tokens = None
    if count:
        tokens = ChunkTokens(section[:KEY_BYTES], section[KEY_BYTES:])
        if hashlib.sha256(KEY_DOMAIN + section).digest() != key:
            raise CorruptRecord("record's token ids do not hash to its key")
    return RecordHeader(namespace, key, header_len, payload_len, payload_crc, tokens)


def verify_payload(header: RecordHeader, payload: Any, namespace: str, key: bytes) -> None:
    """Raise CorruptRecord unless ``payload`` is exactly what ``header`` describes for (namespace, key)."""
    if header.namespace != namespace or header.key != key:
        raise CorruptRecord("record belongs to another key or namespace")
    if memoryview(payload).nbytes != header.payload_len:
        raise CorruptRecord(f"payload is {memoryview(payload).nbytes} bytes, header says {header.payload_len}")
    if checksum(payload) != header.payload_crc:
        raise CorruptRecord("payload checksum mismatch")


def encode_record(namespace: str, key: bytes, payload: Any, tokens: ChunkTokens | None = None) -> memoryview:
    """A whole record (header, with ``tokens`` when given, then a copy of ``payload``)
    in one new buffer (not zeroed first: see :func:`.offload.raw_buffer`)."""
    source = memoryview(payload).cast("B")
    header = encode_header(namespace, key, source, tokens=tokens)
    record = raw_buffer(len(header) + source.nbytes)
    record[: len(header)] = header
    memcopy(record[len(header) :], source)
    return record


def decode_record(record: Any, namespace: str, key: bytes) -> tuple[memoryview, ChunkTokens | None]:
    """The payload of a whole record and its token ids (None: it has none), after every
    check (raises CorruptRecord)."""
    if not isinstance(record, (bytes, bytearray, memoryview)):
        raise CorruptRecord(f"record is a {type(record).__name__}, not bytes")
    header = parse_header(record)
    payload = memoryview(record)[header.header_len :]
    verify_payload(header, payload, namespace, key)
    return payload, header.tokens
