"""The memory tier's per-chunk entries, kept small for millions of chunks.

A stored chunk that is neither leased nor pinned, the usual case, is one int
in the tier's index (:func:`pack`: its offset in pages and its payload size),
no object of its own: ~100 bytes per chunk less than an entry object with
the int of its offset.  A chunk being read or pinned is an :class:`Entry`
(offset, sizes, lease count, flags) until the last lease ends and it is not
pinned; a lease's release closes over that object, so a chunk deleted while
being read keeps it (``dead``) until its extent is freed.

A chunk being written is a :class:`Reservation` until its put commits: room in
the pool the index does not show yet (``UNBOUND`` when reserved for no key).

Primitives: :class:`Entry`, :class:`Reservation`, :func:`pack`, :func:`unpack`,
:func:`packable`, :func:`shared` (one int object per chunk size),
:func:`canonical` (the key with the interned namespace string).
"""

from __future__ import annotations

import dataclasses
import sys

from lmcache_client.keys import ChunkTokens

from ..base import ChunkKey
from .allocator import ALIGNMENT

SIZE_BITS = 40  # payload sizes below 1 TiB pack; a larger chunk keeps its Entry
_SIZE_MASK = (1 << SIZE_BITS) - 1


@dataclasses.dataclass(slots=True, eq=False)
class Entry:
    key: ChunkKey
    offset: int
    size: int
    extent: int  # bytes the allocator gave it (size rounded up to pages)
    leases: int = 0
    pinned: bool = False
    dead: bool = False  # removed from the index; free the extent when the last lease ends
    lent: bool = False  # evicted and lent to the spill: its extent comes back once written


def packable(offset: int, size: int) -> bool:
    return size <= _SIZE_MASK and not offset % ALIGNMENT


def pack(offset: int, size: int) -> int:
    """An unleased, unpinned chunk's entry as one int (see :func:`packable`)."""
    return (offset // ALIGNMENT) << SIZE_BITS | size


def unpack(packed: int) -> tuple[int, int]:
    """``(offset, size)`` of a packed entry."""
    return (packed >> SIZE_BITS) * ALIGNMENT, packed & _SIZE_MASK


_ints: dict[int, int] = {}


def shared(n: int) -> int:
    """One int object per chunk size (a model's chunks are one size), not one per chunk."""
    got = _ints.get(n)
    if got is None:
        if len(_ints) >= 4096:
            return n
        got = _ints[n] = n
    return got


def canonical(key: ChunkKey) -> ChunkKey:
    """``key`` with the one interned string of its namespace (each request decodes
    its own copy: ~150 bytes per chunk if kept)."""
    namespace = sys.intern(key.namespace)
    return key if namespace is key.namespace else ChunkKey(namespace, key.digest)


@dataclasses.dataclass(slots=True, eq=False)
class Reservation:
    """Room in the pool for one chunk, not yet visible (see :meth:`.tier.MemoryTier.reserve`)."""

    key: ChunkKey
    offset: int
    size: int
    parent: ChunkKey | None
    view: memoryview
    tokens: ChunkTokens | None = None
    """The chunk's token ids, when its put sent them (announced at commit, then dropped)."""
    charged: int = 0
    """Bytes (its extent) reserved in its tenant's quota until it commits or is aborted,
    so that the chunks of one batch cannot each pass the quota check alone."""


UNBOUND = ChunkKey("", b"")
"""The key of room reserved for no chunk yet (:meth:`.tier.MemoryTier.reserve_room`)."""
