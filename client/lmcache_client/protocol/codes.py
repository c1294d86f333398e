"""Stable numeric codes of wire protocol v1: operations, error codes, put statuses.

The integer values are part of the protocol: never renumber, only append.
"""

from __future__ import annotations

import enum

PROTOCOL_VERSION = 1
"""The protocol version carried in every header as ``v``."""

KEY_BYTES = 32
"""Every chunk key is exactly this many bytes (a SHA-256 digest, see keys.py)."""

MAX_NAMESPACE_BYTES = 512
"""Longest namespace, in UTF-8 bytes."""

MAX_KEYS_PER_REQUEST = 16384
"""The largest ``max_keys_per_request`` a server may be configured with: what bounds
the header limit (:func:`header_limit`), whatever the configuration."""

HEADER_BYTES_PER_KEY = 2 + KEY_BYTES + 9
"""The most a legitimate header spends per key: the key as msgpack bin 8 (``c4 20``
and 32 bytes), and one integer per key in ``sizes`` (alloc) or ``slots`` (bind)
at its longest (a uint64: ``cf`` and 8 bytes; offsets in a pool over 4 GiB)."""

HEADER_FIXED_BYTES = 4096
"""What a legitimate header spends on everything else, with room: the map and its
two per-key arrays' headers (3 + 2 x 5), a namespace at its longest (3 + 512), the
shared-memory segment's name (a path, at most 255 + 2) and the dozen small fields
(name and value, at most ~30 bytes each)."""


def header_limit(max_keys: int) -> int:
    """The header frame limit for a server taking ``max_keys`` keys per request: the
    largest legitimate header (:data:`HEADER_BYTES_PER_KEY` per key, plus
    :data:`HEADER_FIXED_BYTES`), at least 64 KiB, and never more than
    :data:`MAX_HEADER_BYTES` (ValueError past :data:`MAX_KEYS_PER_REQUEST`)."""
    if not 1 <= max_keys <= MAX_KEYS_PER_REQUEST:
        raise ValueError(f"max_keys must be 1..{MAX_KEYS_PER_REQUEST}, not {max_keys}")
    return max(64 * 1024, HEADER_BYTES_PER_KEY * max_keys + HEADER_FIXED_BYTES)


MAX_HEADER_BYTES = HEADER_BYTES_PER_KEY * MAX_KEYS_PER_REQUEST + HEADER_FIXED_BYTES
"""The longest header any server decodes (708,608 bytes): a header costs the decoder
about 100 ns and up to ~70 bytes of Python objects per byte, so this bounds what one
header can cost (a 4.7 MB header of empty arrays took 467 ms and 324 MiB)."""


class Op(str, enum.Enum):
    """Operation names, sent as the header's ``op`` string."""

    HELLO = "hello"
    PING = "ping"
    PUT = "put"
    GET = "get"
    LOOKUP = "lookup"
    EXISTS = "exists"
    DELETE = "delete"
    CLEAR = "clear"
    PIN = "pin"
    UNPIN = "unpin"
    STATS = "stats"
    # Shared-memory data path (same host only; see docs/protocol.md).
    ALLOC = "alloc"
    COMMIT = "commit"
    RELEASE = "release"
    BIND = "bind"
    """A put into staged slots (a commit's ``stage``): bind them to keys and commit, one round trip."""
    PREFETCH = "prefetch"
    """The operator's cache API: promote chunks from disk or Redis into memory now (docs/protocol.md)."""


class ErrorCode(enum.IntEnum):
    """Error codes of an error reply (header ``code``); ``name`` is sent too."""

    MALFORMED = 1
    """The header frame is not a msgpack map, or a field has the wrong type."""
    UNSUPPORTED_VERSION = 2
    """The header's ``v`` is not a protocol version the server speaks."""
    UNKNOWN_OP = 3
    """The header's ``op`` is not an operation of this version."""
    BAD_REQUEST = 4
    """A required field is missing or a value is out of range."""
    BAD_KEY = 5
    """A key is not exactly KEY_BYTES bytes."""
    PAYLOAD_MISMATCH = 6
    """The number of payload frames does not match the op (put: one per key)."""
    TOO_LARGE = 7
    """The message, a frame or the header is larger than the server accepts."""
    TOO_MANY_KEYS = 8
    """More keys in one request than the server's max_keys_per_request."""
    BAD_NAMESPACE = 9
    """The namespace is missing, empty, too long or not a string.  (A msgpack
    str that is not valid UTF-8 makes the whole header MALFORMED.)"""
    BUSY = 10
    """The in-flight byte budget is spent: retry later (or treat as a miss)."""
    SHUTTING_DOWN = 11
    """The server is draining and accepts no new requests."""
    INTERNAL = 12
    """A bug in the server; the message says no more than that."""
    FORBIDDEN = 13
    """The client's key may not do this: the namespace is not among its
    grants (or is read-only for a write), or the op needs the admin role.
    Sent only with ``auth: curve``; says nothing about what is stored."""
    # 14..19 are left for security codes; the shared-memory codes start at 20.
    STALE_SEGMENT = 20
    """A shared-memory request named a pool segment this server does not have
    (it restarted): say hello again and map the segment it offers."""
    UNKNOWN_LEASE = 21
    """commit/release/bind of a lease that does not exist (never granted, already
    released, or expired after ``shm_lease_timeout_s``)."""
    # The operator's cache API's codes start at 30.
    PIN_LIMIT = 30
    """A pin that would take the pinned bytes past ``max_pinned_fraction`` of the
    memory tier; nothing of the request was pinned."""

    @property
    def retryable(self) -> bool:
        return self in (ErrorCode.BUSY, ErrorCode.SHUTTING_DOWN)


class PutStatus(enum.IntEnum):
    """Per-key outcome of a put, in the reply's ``status`` list."""

    STORED = 0
    """Stored now; visible to readers from this reply on."""
    EXISTS = 1
    """Already stored under this key; nothing written (put is idempotent)."""
    NO_SPACE = 2
    """Not stored: no room even after eviction (pinned or leased chunks fill the pool)."""
    TOO_LARGE = 3
    """Not stored: the chunk is larger than any tier can hold."""
    FAILED = 4
    """Not stored: the client could not reach the server (client-side only, never sent)."""
    SKIPPED = 5
    """Not stored: the cache policy chose not to admit it (e.g. a one-off chunk)."""
