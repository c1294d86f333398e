"""Event block hashes and which announced blocks a topic still holds.

A chunk of ``n * block_size`` tokens is announced as ``n`` blocks.  Their
hashes are a function of the token prefix alone, so every replica and every
node announces the same hash for the same prefix (docs/events.md, "Hashes"):

    block j < n-1:  h = SHA-256(b"lmcache-event-block-v1" || parent || u32le(tokens[: (j+1) * block_size]))
    block n-1:      h = the chunk's own key (it names the same prefix)
    event hash      = the first 8 bytes of h, big-endian, masked to 63 bits

``parent`` is the key of the chunk before it, so the first block's parent
hash is the previous chunk's last block hash (None after the chain root).
63 bits fit consumers that read hashes as int64 and those that read uint64.

Two chunks may share leading blocks (same parent, same first tokens): an index
(one per topic and medium) counts references per block hash, announces a block
when its first holder arrives and removes it when its last holder leaves.

An index also keeps, per chunk, its parent hash and token ids (the packed
u32le bytes the put carried: 4 bytes a token, shared with the record the
put built) and its parent key, so a snapshot or a medium change can announce
the chunk again, and its records below memory can carry its token ids.

Primitives: :func:`block_hashes`, :func:`parent_hash`, :class:`Held`, :class:`BlockIndex`.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from lmcache_client.keys import ROOT_KEY

from ..storage.base import ChunkKey

BLOCK_DOMAIN = b"lmcache-event-block-v1"
HASH_MASK = (1 << 63) - 1


def event_hash(digest: bytes) -> int:
    """The 63-bit event hash of a 32-byte digest."""
    return int.from_bytes(digest[:8], "big") & HASH_MASK


def parent_hash(parent: bytes) -> int | None:
    """The hash of the block before a chunk's first block (None: the chain starts here)."""
    return None if parent == ROOT_KEY else event_hash(parent)


def block_hashes(key: bytes, parent: bytes, packed: bytes, block_size: int) -> list[int]:
    """The event hash of each block of a chunk (``packed``: its u32le token ids, a
    whole number of blocks)."""
    step = 4 * block_size
    n = len(packed) // step
    h = hashlib.sha256(BLOCK_DOMAIN + parent)
    update, copy = h.update, h.copy
    digests: list[bytes] = []
    append = digests.append
    for at in range(0, (n - 1) * step, step):
        update(packed[at : at + step])
        append(copy().digest())
    # event_hash of each 32-byte digest at C speed: the top bit of its first byte
    # cleared (HASH_MASK), then its first 8 bytes read big-endian.
    joined = bytearray(b"".join(digests))
    joined[::32] = joined[::32].translate(_CLEAR_TOP_BIT)
    out = list(_first_words(n - 1).unpack(joined))
    out.append(event_hash(key))
    return out


_CLEAR_TOP_BIT = bytes(range(128)) * 2
"""A ``bytes.translate`` table: b -> b & 0x7f."""
_WORDS: dict[int, struct.Struct] = {}


def _first_words(n: int) -> struct.Struct:
    """The struct that reads the first 8 bytes (big-endian) of each of ``n`` 32-byte digests."""
    words = _WORDS.get(n)
    if words is None:
        words = _WORDS[n] = struct.Struct(">" + "Q24x" * n)
    return words


class Held(NamedTuple):
    """What an index keeps of one announced chunk (never mutated once built)."""

    hashes: array[int]
    """Its block hashes (array('Q'): 8 bytes a block)."""
    parent: int | None
    """The hash of the block before its first one (None: the chain root)."""
    packed: bytes
    """Its token ids, u32le."""
    parent_key: bytes = b""
    """The key of the chunk before it (b"": not known, a file kept by an older daemon)."""

    @property
    def nbytes(self) -> int:
        """Bytes of hashes, token ids and parent key kept for it."""
        return 8 * len(self.hashes) + len(self.packed) + len(self.parent_key)


class BlockIndex:
    """The blocks one topic has announced with one medium: per chunk what
    :class:`Held` keeps, per hash how many announced chunks hold it."""

    def __init__(self) -> None:
        self._chunks: dict[ChunkKey, Held] = {}
        self._refs: dict[int, int] = {}
        self._multi: set[int] = set()  # the hashes more than one chunk holds
        self.nbytes = 0
        """Bytes of block hashes and token ids kept (:attr:`Held.nbytes`, summed)."""

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._chunks

    def __len__(self) -> int:
        """Announced chunks."""
        return len(self._chunks)

    @property
    def blocks(self) -> int:
        """Distinct announced blocks."""
        return len(self._refs)

    def get(self, key: ChunkKey) -> Held | None:
        return self._chunks.get(key)

    def items(self) -> Iterator[tuple[ChunkKey, Held]]:
        """Every announced chunk, in the order it was added."""
        return iter(self._chunks.items())

    def listing(self) -> tuple[list[Held], set[int]]:
        """Every announced chunk in the order it was added, and (a copy of) the blocks
        more than one chunk holds: a chunk whose first block is not among them shares
        no block (two chunks that share a block share every block before it)."""
        return list(self._chunks.values()), set(self._multi)

    def add(
        self,
        key: ChunkKey,
        hashes: Sequence[int],
        parent: int | None = None,
        packed: bytes = b"",
        parent_key: bytes = b"",
    ) -> int:
        """Record ``key``'s blocks; returns how many leading blocks were already
        announced (held by another chunk): only the rest are new."""
        held = Held(array("Q", hashes), parent, packed, parent_key)
        self._chunks[key] = held
        self.nbytes += held.nbytes
        shared = 0
        for i, h in enumerate(hashes):
            count = self._refs.get(h, 0)
            self._refs[h] = count + 1
            if count:
                self._multi.add(h)
                if shared == i:
                    shared += 1
        return shared

    def remove(self, key: ChunkKey) -> list[int]:
        """Forget ``key``; returns the hashes no announced chunk holds any more."""
        held = self._chunks.pop(key, None)
        if held is None:
            return []
        self.nbytes -= held.nbytes
        gone = []
        for h in held.hashes:
            count = self._refs[h] - 1
            if count:
                self._refs[h] = count
                if count == 1:
                    self._multi.discard(h)
            else:
                del self._refs[h]
                gone.append(h)
        return gone

    def remove_namespace(self, namespace: str) -> list[int]:
        """Forget every chunk of ``namespace``; returns the hashes no chunk holds any more."""
        gone: list[int] = []
        for key in [k for k in self._chunks if k.namespace == namespace]:
            gone.extend(self.remove(key))
        return gone

    def clear(self) -> None:
        self._chunks.clear()
        self._refs.clear()
        self._multi.clear()
        self.nbytes = 0
