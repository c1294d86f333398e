"""The warm-restart index file (storage/memory/warmstart.py): what it holds, its
bytes, and the checks that it can be adopted.

What the index holds, in msgpack under a magic, a format version and a
BLAKE2b digest of the body:

- every stored chunk: namespace, digest, offset, size, pinned; in the
  eviction policy's order (next victim first), so the order survives.
  Frequencies of ``lfuda``/``adaptive`` start again at one;
- the shared-memory leases alive at the stop (server/shm/leases.py): read leases
  (the chunks a client may still be copying out of) and write slots (reserved,
  never committed: a client may still be copying into them).  The next daemon
  keeps a read lease's extents until its deadline (CLOCK_MONOTONIC is the
  host's, so deadlines carry over) and holds every write slot in its
  quarantine under the same lease id, until its writer's late
  ``commit``/``release`` arrives (refused, the write is aborted), its process
  is gone, or ``QUARANTINE_FACTOR`` lease timeouts passed: a writer that was
  mid-copy when the old daemon stopped can never write into a reused slot.

Primitives: :class:`WarmIndex`, :class:`HeldLease`, :class:`HeldSlot`,
:func:`encode`, :func:`decode`, :func:`check`, :class:`WarmIndexError`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from typing import Any

import msgpack

from ..base import ChunkKey
from .allocator import ExtentAllocator, aligned

FORMAT_VERSION = 2
MAGIC = b"LMCWARM\x00"
_HEADER = struct.Struct("<8sIIQ32s")  # magic, version, reserved, body length, blake2b-256 of the body


class WarmIndexError(ValueError):
    """An index that cannot be adopted; the message says why (logged once)."""


@dataclasses.dataclass(frozen=True, slots=True)
class HeldSlot:
    """One extent of a lease carried over a restart (``key``: a write slot's chunk)."""

    offset: int
    size: int
    key: ChunkKey | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class HeldLease:
    """A shared-memory lease alive at a clean stop.

    ``deadline``: a read lease's expiry, or when a write slot's quarantine
    clock starts (server/shm/leases.py); ``owner``: a write lease's owner field."""

    lease: int
    write: bool
    deadline: float
    owner: dict[str, int] | None
    slots: tuple[HeldSlot, ...]


@dataclasses.dataclass(frozen=True)
class WarmIndex:
    segment: str
    pool_size: int
    identity: tuple[str, ...]
    boot_id: str
    written_at: float
    chunks: list[tuple[ChunkKey, int, int, bool]]
    leases: list[HeldLease]
    installation: str = ""
    """The daemon installation that wrote it (:func:`.warmstart.installation_id`)."""


# -- the file format ---------------------------------------------------------------
def encode(index: WarmIndex) -> bytes:
    """The index file's bytes: header (magic, version, length, digest), then the msgpack body."""
    body: bytes = msgpack.packb(
        {
            "segment": index.segment,
            "pool_size": index.pool_size,
            "identity": list(index.identity),
            "installation": index.installation,
            "boot_id": index.boot_id,
            "written_at": index.written_at,
            "chunks": [[k.namespace, k.digest, off, size, pinned] for k, off, size, pinned in index.chunks],
            "leases": [
                [
                    h.lease,
                    h.write,
                    h.deadline,
                    h.owner,
                    [
                        [s.offset, s.size, *((s.key.namespace, s.key.digest) if s.key else (None, None))]
                        for s in h.slots
                    ],
                ]
                for h in index.leases
            ],
        },
        use_bin_type=True,
    )
    digest = hashlib.blake2b(body, digest_size=32).digest()
    return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(body), digest) + body


def decode(raw: bytes) -> WarmIndex:
    """The index in ``raw``; WarmIndexError saying what is wrong with it."""
    if len(raw) < _HEADER.size:
        raise WarmIndexError(f"index truncated ({len(raw)} bytes)")
    magic, version, _, length, digest = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise WarmIndexError("not an index file (bad magic)")
    if version != FORMAT_VERSION:
        raise WarmIndexError(f"index format version {version}, this daemon reads version {FORMAT_VERSION}")
    body = raw[_HEADER.size :]
    if len(body) != length:
        raise WarmIndexError(f"index truncated ({len(body)} of {length} body bytes)")
    if hashlib.blake2b(body, digest_size=32).digest() != digest:
        raise WarmIndexError("index checksum mismatch (corrupt)")
    try:
        m = msgpack.unpackb(body, raw=False, strict_map_key=True)
        chunks = [(ChunkKey(_str(ns), _bytes(d)), _uint(o), _uint(n, 1), _bool(p)) for ns, d, o, n, p in m["chunks"]]
        leases = [
            HeldLease(
                _uint(lease, 1),
                _bool(write),
                float(deadline),
                {str(k): int(v) for k, v in owner.items()} if owner is not None else None,
                tuple(
                    HeldSlot(_uint(o), _uint(n, 1), ChunkKey(_str(ns), _bytes(d)) if d is not None else None)
                    for o, n, ns, d in slots
                ),
            )
            for lease, write, deadline, owner, slots in m["leases"]
        ]
        return WarmIndex(
            _str(m["segment"]),
            _uint(m["pool_size"], 1),
            tuple(_str(x) for x in m["identity"]),
            _str(m["boot_id"]),
            float(m["written_at"]),
            chunks,
            leases,
            _str(m["installation"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError, msgpack.UnpackException) as err:
        raise WarmIndexError(f"malformed index ({type(err).__name__}: {err})") from err


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {type(v).__name__}")
    return v


def _bytes(v: Any) -> bytes:
    if not isinstance(v, bytes):
        raise TypeError(f"expected bytes, got {type(v).__name__}")
    return v


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"expected a boolean, got {type(v).__name__}")
    return v


def _uint(v: Any, least: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < least:
        raise ValueError(f"expected an integer >= {least}, got {v!r}")
    return v


def _leases_kept(index: WarmIndex, now: float) -> tuple[list[HeldLease], list[HeldLease], list[tuple[int, int]]]:
    """Read leases still alive, every write lease, and the extents they hold that
    no stored chunk covers (those the adopted allocator must keep allocated)."""
    at = {offset: size for _, offset, size, _ in index.chunks}
    reads = [h for h in index.leases if not h.write and h.deadline > now]
    writes = [h for h in index.leases if h.write]
    held: dict[int, int] = {}
    for lease in reads + writes:
        for s in lease.slots:
            if lease.write or at.get(s.offset) != s.size:
                if held.get(s.offset, s.size) != s.size:
                    raise WarmIndexError(f"two leases hold different extents at offset {s.offset}")
                held[s.offset] = s.size
    return reads, writes, sorted(held.items())


def check(index: WarmIndex, pool_size: int) -> None:
    """Raise WarmIndexError unless every extent is page-aligned, inside the pool,
    overlapping no other, and no key is listed twice."""
    keys = {key for key, _, _, _ in index.chunks}
    if len(keys) != len(index.chunks):
        raise WarmIndexError("a chunk is listed twice")
    _, _, held = _leases_kept(index, float("-inf"))
    extents = [(o, aligned(n)) for _, o, n, _ in index.chunks] + [(o, aligned(n)) for o, n in held]
    try:
        ExtentAllocator.with_used(pool_size, extents)
    except ValueError as err:
        raise WarmIndexError(f"inconsistent extents: {err}") from None
