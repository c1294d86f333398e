"""Canonical chunk keys: a SHA-256 hash chain over the token ids of full chunks.

Algorithm (version 1), identical in every process, host and Python version:

    prev_0 = 32 zero bytes
    key_i  = SHA-256( b"lmcache-chunk-v1" || prev_i || u32le(tokens of chunk i) )
    prev_{i+1} = key_i

where ``u32le`` packs each token id as an unsigned 32-bit little-endian
integer and chunk ``i`` covers tokens ``[i*chunk_size, (i+1)*chunk_size)``.
Because each key folds in every earlier chunk, a key names a whole prefix.

A prompt's trailing partial chunk (``0 < n < chunk_size`` tokens after its
last full chunk) may be stored too, under a *tail key* of another domain that
also folds in the tail's length:

    tail = SHA-256( b"lmcache-tail-v1" || prev || u32le(n) || u32le(tokens of the tail) )

so a tail key names the exact whole prompt and can never equal the key of a
full chunk (another domain prefix), nor the tail of another prompt.  The
prefill/decode handoff stores tails so a decoder computes only the last token.
A tail of one token is never stored: that token is the prompt's last, which an
engine always computes to get logits (:func:`prompt_keys`, the one place of
this rule for the vLLM connector and the admin CLI).

A request whose KV depends on more than its tokens (a LoRA adapter, a
per-request cache salt) starts its chain from another root:
``prev_0 = SHA-256(b"lmcache-root-v1" || for each part: u32le(len) || utf-8 part)``
(:func:`salted_root`), so it shares chunks only with requests of the same parts.

Primitives: :func:`chunk_keys` (tokens -> keys), :func:`chain_key` (one step),
:func:`tail_key` (a prompt's partial last chunk), :func:`prompt_keys` (a prompt's
stored keys: its full chunks' and its tail's), :func:`salted_root`, :func:`request_root`,
:class:`ChunkHasher`, which remembers the chunk size, and :class:`ChunkTokens`
with :func:`chunk_tokens` and :func:`pack_chunk_tokens`: what a put may say about each chunk's tokens (the
daemon announces them to KV-aware routers, docs/events.md).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from .protocol.codes import KEY_BYTES

KEY_DOMAIN = b"lmcache-chunk-v1"
TAIL_DOMAIN = b"lmcache-tail-v1"
ROOT_KEY = bytes(KEY_BYTES)
MIN_TAIL_TOKENS = 2
"""A prompt's partial last chunk is stored only from this many tokens: a one-token
tail holds only the last token, which the engine always recomputes."""
_MAX_TOKEN_ID = 2**32 - 1


def _pack_tokens(tokens: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:
        bad = next(t for t in tokens if not (isinstance(t, int) and 0 <= t <= _MAX_TOKEN_ID))
        raise ValueError(f"token id {bad!r} is not an unsigned 32-bit integer") from None


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as the keys hash them: unsigned 32-bit little-endian."""
    return _pack_tokens(tokens)


class ChunkTokens(NamedTuple):
    """A chunk's token ids for a put's ``tokens`` field: ``key == chain_key(parent, ids)``."""

    parent: bytes
    """The key of the chunk before it (the chain root for the first chunk)."""
    packed: bytes
    """The token ids, packed by :func:`pack_tokens`."""


def pack_chunk_tokens(tokens: Sequence[ChunkTokens | None]) -> bytes:
    """The tokens frame of a put, alloc or bind (docs/protocol.md): for each key in
    order, u32le(number of ids) (0: nothing said about that chunk), then, when not
    0, the 32-byte parent key and the packed ids."""
    parts: list[bytes] = []
    for t in tokens:
        if t is None:
            parts.append(b"\0\0\0\0")
        else:
            parts += (struct.pack("<I", len(t.packed) // 4), t.parent, t.packed)
    return b"".join(parts)


def chain_key(prev: bytes, chunk_tokens: Sequence[int]) -> bytes:
    """The key of one chunk given the key of the chunk before it (ROOT_KEY for the first)."""
    if len(prev) != KEY_BYTES:
        raise ValueError(f"previous key must be {KEY_BYTES} bytes, got {len(prev)}")
    return hashlib.sha256(KEY_DOMAIN + prev + _pack_tokens(chunk_tokens)).digest()


def tail_key(prev: bytes, tail_tokens: Sequence[int]) -> bytes:
    """The key of a prompt's partial last chunk given the key of the full chunk before
    it (the chain root when the prompt is shorter than one chunk)."""
    if len(prev) != KEY_BYTES:
        raise ValueError(f"previous key must be {KEY_BYTES} bytes, got {len(prev)}")
    if not tail_tokens:
        raise ValueError("a tail holds at least one token")
    return hashlib.sha256(TAIL_DOMAIN + prev + struct.pack("<I", len(tail_tokens)) + _pack_tokens(tail_tokens)).digest()


def salted_root(*parts: str) -> bytes:
    """The chain root of requests whose KV also depends on ``parts`` (ROOT_KEY for none)."""
    if not parts:
        return ROOT_KEY
    h = hashlib.sha256(b"lmcache-root-v1")
    for part in parts:
        data = part.encode()
        h.update(struct.pack("<I", len(data)) + data)
    return h.digest()


def request_root(lora: str | None = None, salt: str | None = None, tags: Sequence[str] = ()) -> bytes:
    """The chain root of a request served with LoRA adapter ``lora``, ``cache_salt``
    ``salt`` and tags ``tags`` (in the given order; the vLLM connector passes them as a
    sorted set): each part only when given, ``lora`` even when empty (ROOT_KEY for none)."""
    parts: list[str] = []
    if lora is not None:
        parts.append("lora=" + lora)
    if salt:
        parts.append("salt=" + salt)
    if tags:
        parts.append("tags=" + "\x1f".join(tags))
    return salted_root(*parts)


def chunk_keys(tokens: Sequence[int] | Iterable[int], chunk_size: int, root: bytes = ROOT_KEY) -> list[bytes]:
    """Keys of every full chunk of ``tokens``, in order (a chain from ``root``)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if hasattr(tokens, "tolist"):  # torch tensors and numpy arrays
        seq: Sequence[int] = tokens.tolist()
    elif isinstance(tokens, Sequence):
        seq = tokens
    else:
        seq = list(tokens)
    keys: list[bytes] = []
    prev = root
    for start in range(0, len(seq) - chunk_size + 1, chunk_size):
        prev = chain_key(prev, seq[start : start + chunk_size])
        keys.append(prev)
    return keys


def prompt_keys(prompt: Sequence[int], chunk_size: int, root: bytes = ROOT_KEY) -> tuple[list[bytes], bytes | None]:
    """The keys ``prompt``'s KV is stored under: every full chunk's (a chain from
    ``root``), and its tail's (None unless the prompt ends in a partial chunk of
    :data:`MIN_TAIL_TOKENS` or more: a one-token tail is always recomputed)."""
    keys = chunk_keys(prompt, chunk_size, root)
    start = len(keys) * chunk_size
    if len(prompt) - start < MIN_TAIL_TOKENS:
        return keys, None
    return keys, tail_key(keys[-1] if keys else root, prompt[start:])


def chunk_tokens(tokens: Sequence[int] | Iterable[int], chunk_size: int, root: bytes = ROOT_KEY) -> list[ChunkTokens]:
    """The :class:`ChunkTokens` of every full chunk of ``tokens`` (in the order of
    :func:`chunk_keys` with the same arguments)."""
    seq: Sequence[int] = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
    keys = chunk_keys(seq, chunk_size, root)
    parents = [root, *keys[:-1]]
    n = chunk_size
    return [ChunkTokens(parent, _pack_tokens(seq[i * n : (i + 1) * n])) for i, parent in enumerate(parents)]


class ChunkHasher:
    """Chunk keys for one chunk size: ``ChunkHasher(256).keys(token_ids)``."""

    def __init__(self, chunk_size: int):
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.chunk_size = chunk_size

    def keys(self, tokens: Sequence[int] | Iterable[int]) -> list[bytes]:
        return chunk_keys(tokens, self.chunk_size)

    def full_chunks(self, num_tokens: int) -> int:
        return num_tokens // self.chunk_size
