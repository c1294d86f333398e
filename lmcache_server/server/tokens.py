"""The optional token ids of put, alloc and bind: each chunk's token ids, for KV events.

A request whose header says ``tokens: true`` carries one more frame, last:
for each key in order, ``u32le(n)`` (0: nothing said about that chunk), then,
when ``n`` is not 0, ``parent`` (the 32-byte key of the chunk before it, the
chain root for a first chunk) and the ``n`` ids packed as unsigned 32-bit
little-endian integers (docs/protocol.md).  The ids travel outside the
msgpack header, so the header limit leaves no room for them and a header
stays small whatever a client announces.  (The older form, ``tokens`` as an
array of nil or ``[parent, packed ids]`` inside the header, is still read;
it has only the small header's room.)

An entry is accepted only if the key is exactly ``chain_key(parent, ids)``
(lmcache_client.keys) and it holds exactly ``chunk_size`` ids: the tokens
announced for a key are provably the tokens it was computed from, and one
key costs at most a chunk's ids of heap.  (A tail key, of another domain,
never matches ``chain_key``: tails are not announced.)  Anything else refuses
the whole request with BAD_REQUEST (nothing is stored).

The front end parses the ids once, right after the access check
(:func:`take_tokens`); the handlers read the result (:func:`parse_tokens`).

Primitives: :func:`take_tokens`, :func:`parse_tokens`.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

from lmcache_client.keys import KEY_DOMAIN, ChunkTokens
from lmcache_client.protocol import KEY_BYTES, ErrorCode, ProtocolError, Request

_U32 = struct.Struct("<I")
_PARSED = "_tokens"
"""The field the parsed entries are kept in (never a wire field: those are msgpack strings the
decoder copies; this one is set only by :func:`take_tokens`)."""


def take_tokens(request: Request, chunk_size: int) -> None:
    """Parse and check the request's token ids (ProtocolError when malformed, or when an
    entry does not hold exactly ``chunk_size`` ids), keeping the result for :func:`parse_tokens`."""
    raw = request.fields.pop("tokens", None)
    request.fields.pop(_PARSED, None)
    if raw is None:
        return
    if isinstance(raw, list):
        entries = _from_header(request, raw)
    elif isinstance(raw, (bytes, memoryview)):
        entries = _from_frame(request, raw)
    else:
        raise _refuse(request, "must be true (a tokens frame follows) or list one entry per key")
    ids = 4 * chunk_size
    for i, (entry, key) in enumerate(zip(entries, request.keys)):
        if entry is None:
            continue
        if len(entry.packed) != ids:
            raise _refuse(request, f"[{i}] has {len(entry.packed) // 4} token ids; a chunk has {chunk_size}")
        if hashlib.sha256(KEY_DOMAIN + entry.parent + entry.packed).digest() != key:
            raise _refuse(request, f"[{i}]: the token ids and parent do not hash to keys[{i}] (chain_key)")
    request.fields[_PARSED] = entries


def parse_tokens(request: Request) -> list[ChunkTokens | None] | None:
    """The request's token entries, one per key (None when it has none), as
    :func:`take_tokens` checked them."""
    entries: list[ChunkTokens | None] | None = request.fields.get(_PARSED)
    if entries is None and "tokens" in request.fields:
        raise _refuse(request, "were not checked")  # a request that did not come through the front end
    return entries


def _refuse(request: Request, why: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, f"'tokens' {why}", request.id)


def _from_header(request: Request, raw: list[Any]) -> list[ChunkTokens | None]:
    if len(raw) != len(request.keys):
        raise _refuse(
            request, f"must list one entry per key ({len(request.keys)}), each nil or [parent key, packed ids]"
        )
    out: list[ChunkTokens | None] = []
    for i, entry in enumerate(raw):
        if entry is None:
            out.append(None)
            continue
        if not isinstance(entry, list) or len(entry) != 2:
            raise _refuse(request, f"[{i}] must be nil or [parent key, packed token ids]")
        parent, packed = entry
        if not isinstance(parent, bytes) or len(parent) != KEY_BYTES:
            raise _refuse(request, f"[{i}]: the parent must be a {KEY_BYTES}-byte key")
        if not isinstance(packed, bytes) or not packed or len(packed) % 4:
            raise _refuse(request, f"[{i}]: the token ids must be packed u32le bytes (a non-zero multiple of 4)")
        out.append(ChunkTokens(parent, packed))
    return out


def _from_frame(request: Request, raw: Any) -> list[ChunkTokens | None]:
    # bytes are sliced as they are (one copy per slice); any other buffer through a memoryview
    data = raw if isinstance(raw, bytes) else memoryview(raw).cast("B")
    u32 = _U32.unpack_from
    out: list[ChunkTokens | None] = []
    at, end = 0, len(data)
    for i in range(len(request.keys)):
        if at + 4 > end:
            raise _refuse(request, f"frame ends before entry {i} of {len(request.keys)}")
        (n,) = u32(data, at)
        at += 4
        if n == 0:
            out.append(None)
            continue
        ids = at + KEY_BYTES
        stop = ids + 4 * n
        if stop > end:
            raise _refuse(request, f"frame ends inside entry {i} ({n} ids)")
        out.append(ChunkTokens(bytes(data[at:ids]), bytes(data[ids:stop])))
        at = stop
    if at != end:
        raise _refuse(request, f"frame has {end - at} bytes past its {len(request.keys)} entries")
    return out
