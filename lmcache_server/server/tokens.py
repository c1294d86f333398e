"""The optional ``tokens`` field of put and alloc: each chunk's token ids, for KV events.

``tokens`` lists one entry per key: nil (nothing said about that chunk) or
``[parent, ids]``, ``parent`` the 32-byte key of the chunk before it (the
chain root for a first chunk) and ``ids`` its token ids packed as unsigned
32-bit little-endian integers (docs/protocol.md).  An entry is accepted only
if the key is exactly ``chain_key(parent, ids)`` (lmcache_client.keys): the
tokens announced for a key are provably the tokens it was computed from.
Anything else refuses the whole request with BAD_REQUEST (nothing is stored).

Clients send the field only to a daemon whose hello offers ``events``; only
then does the header limit make room for it (:func:`token_header_bytes`).

Primitives: :func:`parse_tokens`, :func:`token_header_bytes`.
"""

from __future__ import annotations

import hashlib

from lmcache_client.keys import KEY_DOMAIN, ChunkTokens
from lmcache_client.protocol import KEY_BYTES, ErrorCode, ProtocolError, Request

from ..config import ServerConfig


def token_header_bytes(config: ServerConfig) -> int:
    """Header bytes a request may spend on ``tokens`` (a chunk_size of ids per key), with events on."""
    if config.events_endpoint is None:
        return 0
    return int(config.max_keys_per_request * (4 * config.chunk_size + KEY_BYTES + 16))


def parse_tokens(request: Request) -> list[ChunkTokens | None] | None:
    """The request's ``tokens`` (None when it has none); ProtocolError when malformed."""
    raw = request.fields.get("tokens")
    if raw is None:
        return None

    def refuse(why: str) -> ProtocolError:
        return ProtocolError(ErrorCode.BAD_REQUEST, f"'tokens' {why}", request.id)

    if not isinstance(raw, list) or len(raw) != len(request.keys):
        raise refuse(f"must list one entry per key ({len(request.keys)}), each nil or [parent key, packed ids]")
    out: list[ChunkTokens | None] = []
    for i, (entry, key) in enumerate(zip(raw, request.keys)):
        if entry is None:
            out.append(None)
            continue
        if not isinstance(entry, list) or len(entry) != 2:
            raise refuse(f"[{i}] must be nil or [parent key, packed token ids]")
        parent, packed = entry
        if not isinstance(parent, bytes) or len(parent) != KEY_BYTES:
            raise refuse(f"[{i}]: the parent must be a {KEY_BYTES}-byte key")
        if not isinstance(packed, bytes) or not packed or len(packed) % 4:
            raise refuse(f"[{i}]: the token ids must be packed u32le bytes (a non-zero multiple of 4)")
        if hashlib.sha256(KEY_DOMAIN + parent + packed).digest() != key:
            raise refuse(f"[{i}]: the token ids and parent do not hash to keys[{i}] (chain_key)")
        out.append(ChunkTokens(parent, packed))
    return out
