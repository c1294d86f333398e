"""What each operation sends and how its reply is read, shared by both clients.

A :class:`Call` holds the request (op, namespace, keys, payloads, fields), a
``parse`` function from the reply to the result, and, for the data ops an
engine calls in its inference path, the ``miss`` result to return instead of
raising when the daemon is unreachable (fail-open).

The sync and asyncio clients differ only in how they move frames; every
op's meaning lives here, once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from .errors import ServerError
from .keys import ChunkTokens, pack_chunk_tokens
from .protocol import ErrorCode, Op, PutStatus, Reply

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class LookupResult:
    """How many leading keys are cached, and where each key was found."""

    hit_chunks: int
    tiers: list[str | None]


@dataclasses.dataclass(frozen=True)
class PrefetchResult:
    """What a ``prefetch`` did: which keys memory holds now, and how they got there."""

    in_memory: list[bool]
    """Per key: memory holds the chunk after the prefetch."""
    was_in_memory: int
    """Keys memory held before."""
    promoted: int
    """Chunks promoted from disk or Redis into memory, and their payload bytes:"""
    promoted_bytes: int
    declined: int
    """Chunks a lower tier holds that were not promoted (no room in the in-flight budget or memory)."""


@dataclasses.dataclass(frozen=True)
class Call(Generic[T]):
    op: Op
    parse: Callable[[Reply, list[Any]], T]
    namespace: str | None = None
    keys: Sequence[bytes] | None = None
    payloads: Sequence[Any] = ()
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    miss: Callable[[], T] | None = None
    """Fail-open result; None means the call raises when the daemon is unreachable."""

    def result(self, reply: Reply, payloads: list[Any]) -> T:
        """The op's result; raises ServerError for an error reply (BUSY included:
        the client decides whether BUSY fails open)."""
        if not reply.ok:
            raise ServerError(reply.code if reply.code is not None else -1, reply.message)
        return self.parse(reply, payloads)


def _field(reply: Reply, name: str) -> Any:
    try:
        return reply.fields[name]
    except KeyError:
        raise ServerError(ErrorCode.INTERNAL, f"reply lacks field {name!r}") from None


def hello(client_name: str) -> Call[dict[str, Any]]:
    return Call(Op.HELLO, lambda r, _: dict(r.fields), fields={"client": client_name})


def ping() -> Call[float]:
    sent = time.perf_counter()
    return Call(Op.PING, lambda r, _: time.perf_counter() - sent)


def _put_status(value: int) -> PutStatus | int:
    """A known PutStatus, or the bare int of one added by a newer server."""
    try:
        return PutStatus(value)
    except ValueError:
        return value


TokensArg = Sequence[ChunkTokens | None] | None
"""A put's optional token ids: one :class:`ChunkTokens` (or None) per key (docs/events.md)."""


def _tokens_field(keys: Sequence[bytes], tokens: TokensArg) -> tuple[dict[str, Any], list[bytes]]:
    """The header field and the extra last frame that carry ``tokens`` (none without)."""
    if tokens is None:
        return {}, []
    if len(tokens) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(tokens)} token entries")
    return {"tokens": True}, [pack_chunk_tokens(tokens)]


def put(
    namespace: str, keys: Sequence[bytes], payloads: Sequence[Any], tokens: TokensArg = None
) -> Call[list[PutStatus | int]]:
    if len(keys) != len(payloads):
        raise ValueError(f"{len(keys)} keys but {len(payloads)} payloads")
    n = len(keys)
    fields, token_frame = _tokens_field(keys, tokens)
    return Call(
        Op.PUT,
        lambda r, _: [_put_status(s) for s in _field(r, "status")],
        namespace,
        keys,
        [*payloads, *token_frame] if token_frame else payloads,
        fields=fields,
        miss=lambda: [PutStatus.FAILED] * n,
    )


def get(namespace: str, keys: Sequence[bytes]) -> Call[list[Any | None]]:
    n = len(keys)

    def parse(reply: Reply, payloads: list[Any]) -> list[Any | None]:
        found = _field(reply, "found")
        if len(found) != n or sum(map(bool, found)) != len(payloads):
            raise ServerError(ErrorCode.INTERNAL, "get reply does not match its payloads")
        it = iter(payloads)
        return [next(it) if hit else None for hit in found]

    return Call(Op.GET, parse, namespace, keys, miss=lambda: [None] * n)


def lookup(
    namespace: str, keys: Sequence[bytes], *, prefetch: bool = False, cancel_prefetch: bool = False
) -> Call[LookupResult]:
    """``prefetch``: the daemon also promotes the leading hits it holds on disk or in
    Redis into memory after replying (docs/protocol.md 5.5); ``cancel_prefetch``: it
    gives up the prefetches an earlier lookup of these keys joined (the request ended
    before its load).  Servers older than the flags ignore them."""
    if prefetch and cancel_prefetch:
        raise ValueError("a lookup either prefetches or cancels prefetches, not both")
    n = len(keys)
    return Call(
        Op.LOOKUP,
        lambda r, _: LookupResult(int(_field(r, "hits")), list(_field(r, "tiers"))),
        namespace,
        keys,
        fields={"prefetch": True} if prefetch else {"cancel_prefetch": True} if cancel_prefetch else {},
        miss=lambda: LookupResult(0, [None] * n),
    )


def exists(namespace: str, keys: Sequence[bytes]) -> Call[list[bool]]:
    n = len(keys)
    return Call(
        Op.EXISTS,
        lambda r, _: [bool(x) for x in _field(r, "exists")],
        namespace,
        keys,
        miss=lambda: [False] * n,
    )


def _bool_list(field: str) -> Callable[[Reply, list[Any]], list[bool]]:
    return lambda r, _: [bool(x) for x in _field(r, field)]


def delete(namespace: str, keys: Sequence[bytes]) -> Call[list[bool]]:
    return Call(Op.DELETE, _bool_list("deleted"), namespace, keys)


def pin(namespace: str, keys: Sequence[bytes]) -> Call[list[bool]]:
    return Call(Op.PIN, _bool_list("pinned"), namespace, keys)


def unpin(namespace: str, keys: Sequence[bytes]) -> Call[list[bool]]:
    return Call(Op.UNPIN, _bool_list("unpinned"), namespace, keys)


def prefetch(namespace: str, keys: Sequence[bytes]) -> Call[PrefetchResult]:
    """Promote the chunks of ``keys`` that disk or Redis holds into memory (answered when done)."""

    def parse(reply: Reply, _: list[Any]) -> PrefetchResult:
        return PrefetchResult(
            [bool(x) for x in _field(reply, "in_memory")],
            int(_field(reply, "was_in_memory")),
            int(_field(reply, "promoted")),
            int(_field(reply, "promoted_bytes")),
            int(_field(reply, "declined")),
        )

    return Call(Op.PREFETCH, parse, namespace, keys)


def clear(namespace: str | None) -> Call[int]:
    """Clear one namespace, or every namespace when ``namespace`` is None."""
    fields = {} if namespace is not None else {"all": True}
    return Call(Op.CLEAR, lambda r, _: int(_field(r, "removed")), namespace, fields=fields)


def stats(namespace: str | None = None) -> Call[dict[str, Any]]:
    return Call(Op.STATS, lambda r, _: dict(_field(r, "stats")), namespace)


# -- the shared-memory data path (see lmcache_client.shm) ------------------------------------------
@dataclasses.dataclass(frozen=True)
class ShmGrant:
    """A get or alloc answered with pool locations under a lease."""

    loc: list[list[int] | None]
    """(offset, length) in the pool per key; None: not in the pool."""
    lease: int | None
    """The lease to release (get) or commit (alloc); None when nothing was leased."""
    expires: float
    """The lease's deadline on CLOCK_MONOTONIC."""
    found: list[bool] = dataclasses.field(default_factory=list)
    """get: whether each key was a hit (a hit without a location came as a payload frame)."""
    payloads: list[Any] = dataclasses.field(default_factory=list)
    status: list[PutStatus | int] = dataclasses.field(default_factory=list)
    """alloc: STORED where a slot was reserved, else why not."""


def _grant(reply: Reply, n: int) -> ShmGrant:
    loc = _field(reply, "loc")
    lease = reply.fields.get("lease")
    if len(loc) != n or (lease is None) != all(x is None for x in loc):
        raise ServerError(ErrorCode.INTERNAL, "shared-memory reply does not match its request")
    return ShmGrant([list(x) if x is not None else None for x in loc], lease, float(reply.fields.get("expires", 0.0)))


def get_shm(namespace: str, keys: Sequence[bytes], segment: str) -> Call[ShmGrant]:
    n = len(keys)

    def parse(reply: Reply, payloads: list[Any]) -> ShmGrant:
        grant = _grant(reply, n)
        found = [bool(x) for x in _field(reply, "found")]
        framed = sum(1 for hit, loc in zip(found, grant.loc) if hit and loc is None)
        if len(found) != n or framed != len(payloads):
            raise ServerError(ErrorCode.INTERNAL, "get reply does not match its payloads")
        return dataclasses.replace(grant, found=found, payloads=payloads)

    return Call(Op.GET, parse, namespace, keys, fields={"shm": segment})


def alloc(
    namespace: str,
    keys: Sequence[bytes],
    sizes: Sequence[int],
    segment: str,
    owner: dict[str, int] | None = None,
    tokens: TokensArg = None,
    nonce: int | None = None,
    deadline: float | None = None,
) -> Call[ShmGrant]:
    """Reserve pool slots under a write lease; ``owner`` names this process so the daemon
    can tell when a writer whose lease expired can no longer write (shm.owner());
    ``nonce`` (a random positive 63-bit integer) lets :func:`release` free the
    grant even if its reply was never seen; ``deadline`` (CLOCK_MONOTONIC
    seconds, this host) is when the caller stops waiting: nothing is granted past it."""
    n = len(keys)

    def parse(reply: Reply, _: list[Any]) -> ShmGrant:
        grant = _grant(reply, n)
        status = [_put_status(s) for s in _field(reply, "status")]
        return dataclasses.replace(grant, status=status)

    token_field, token_frame = _tokens_field(keys, tokens)
    fields: dict[str, Any] = {"sizes": list(sizes), "shm": segment, **token_field}
    if owner is not None:
        fields["owner"] = owner
    if nonce is not None:
        fields["nonce"] = nonce
    if deadline is not None:
        fields["deadline"] = deadline
    return Call(Op.ALLOC, parse, namespace, keys, token_frame, fields=fields)


def commit(lease: int, segment: str) -> Call[list[PutStatus | int]]:
    return Call(
        Op.COMMIT, lambda r, _: [_put_status(s) for s in _field(r, "status")], fields={"lease": lease, "shm": segment}
    )


def release(leases: Sequence[int]) -> Call[list[bool]]:
    """End read leases, abandon write leases; an alloc's ``nonce`` names its grant too."""
    return Call(Op.RELEASE, _bool_list("released"), fields={"leases": list(leases)})


# -- staged slots: a shared-memory put in one round trip (see lmcache_client.shm) -----------------
@dataclasses.dataclass(frozen=True)
class Staged:
    """Pool slots bound to no key yet, under a write lease (a commit's ``staged`` field)."""

    lease: int
    slots: list[tuple[int, int]]
    """(offset, length) of each slot."""
    expires: float


@dataclasses.dataclass(frozen=True)
class Bound:
    """A bind's answer: one status per key, the slots added to the lease in place of
    those consumed (STORED keys), and the lease's renewed deadline."""

    status: list[PutStatus | int]
    fresh: list[tuple[int, int]]
    expires: float


def _slots(value: Any) -> list[tuple[int, int]]:
    if not isinstance(value, list) or not all(
        isinstance(s, list) and len(s) == 2 and all(type(x) is int for x in s) for s in value
    ):
        raise ServerError(ErrorCode.INTERNAL, "malformed staged slots in reply")
    return [(s[0], s[1]) for s in value]


def commit_staging(
    lease: int, segment: str, stage: Sequence[int], owner: dict[str, int] | None = None
) -> Call[tuple[list[PutStatus | int], Staged | None]]:
    """:func:`commit`, asking for anonymous slots of sizes ``stage`` under a new
    write lease for the next put (None when the daemon declines or predates it)."""

    def parse(reply: Reply, _: list[Any]) -> tuple[list[PutStatus | int], Staged | None]:
        status = [_put_status(s) for s in _field(reply, "status")]
        staged = reply.fields.get("staged")
        if not isinstance(staged, dict):
            return status, None
        lease, expires = staged.get("lease"), staged.get("expires")
        if type(lease) is not int or not isinstance(expires, (int, float)):
            raise ServerError(ErrorCode.INTERNAL, "malformed staged lease in reply")
        return status, Staged(lease, _slots(staged.get("slots")), float(expires))

    fields: dict[str, Any] = {"lease": lease, "shm": segment, "stage": list(stage)}
    if owner is not None:
        fields["owner"] = owner
    return Call(Op.COMMIT, parse, fields=fields)


def bind(
    namespace: str,
    keys: Sequence[bytes],
    slots: Sequence[int],
    lease: int,
    segment: str,
    tokens: TokensArg = None,
) -> Call[Bound]:
    """Bind staged slots (by offset, one per key, already written) to ``keys`` and commit them."""
    n = len(keys)

    def parse(reply: Reply, _: list[Any]) -> Bound:
        status = [_put_status(s) for s in _field(reply, "status")]
        if len(status) != n:
            raise ServerError(ErrorCode.INTERNAL, "bind reply does not match its request")
        return Bound(status, _slots(_field(reply, "fresh")), float(_field(reply, "expires")))

    token_field, token_frame = _tokens_field(keys, tokens)
    fields = {"lease": lease, "shm": segment, "slots": list(slots), **token_field}
    return Call(Op.BIND, parse, namespace, keys, token_frame, fields=fields)
