"""``POST /query`` on the metrics HTTP port: token ids -> the longest prefix this node
holds, in tokens, and how much of it each medium holds (docs/events.md, "Query").

For a router without an indexer (Mooncake's Conductor asks the same question
over HTTP): the answer is the store's own (the fastest local tier of each key,
as ``lookup`` finds it), never a copy that could lag.

Request (JSON, at most :data:`MAX_BODY` bytes, :data:`MAX_TOKENS` ids):
``{"tokens": [int...], "namespace": NS}`` or ``{"tokens": [...], "model": M}``
(every namespace of model ``M`` this node holds that the caller may see),
optional ``"lora"``, ``"salt"``, ``"tags"`` (the chain root, as the vLLM
connector names it: ``keys.request_root``: tags sorted, each part only when
given).  The chunk size is the namespace's ``c<N>`` field, else the daemon's,
never the caller's (a caller-chosen ``chunk_size: 1`` made every query a
262,144-step hash chain).

Answer: ``{"best": {...}, "namespaces": [{"namespace", "chunk_size",
"prefix_tokens", "by_medium": {"CPU": n, "STORAGE": n}}]}`` (``prefix_tokens``:
the leading full chunks that some local tier holds, times the chunk size;
``by_medium``: how many of those tokens each medium holds).  Redis is not
asked (no round trip): with ``events_remote`` the prefix goes on through the
chunks this node knows Redis holds for it, as the events announce them
(locality REMOTE, :mod:`..events.remote`), counted as ``"REMOTE"``.

Cost, bounded so that no query holds the event loop: the body is parsed and
checked on a worker thread; the key chain is hashed lazily, one chunk at a
time, and a namespace's walk stops at its first miss (namespaces of one chunk
size share the chain's hashes); the walk yields to the loop every
:data:`SLICE_S`; and one query takes at most :data:`MAX_STEPS` chunk steps in
all (beyond it the walk stops and the namespace says ``"truncated": true``).
The HTTP endpoint caps concurrent queries and connections (:mod:`.http`).

Who may ask: :class:`~..security.querytokens.QueryAccess` (bearer tokens,
per tenant).  A namespace the caller may not see is answered exactly as one
this node does not hold (404, the same body): no existence oracle.

Errors: 400 (not JSON, a field of the wrong type, too many tokens), 401 (a
bearer token is required and none valid was given), 403 (``/query`` is off),
404 (no such namespace or model on this node, or none the caller may see),
413 (a body over :data:`MAX_BODY`).

Primitives: :class:`QueryError`, :class:`Query` (``scope``, ``answer``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

from lmcache_client.keys import chain_key, request_root
from lmcache_client.namespace import chunk_size_of, of_model

from ..events.announcer import MEDIUM
from ..events.remote import REMOTE
from ..security.querytokens import QueryAccess, QueryScope
from ..storage.base import ChunkKey

MAX_BODY = 4 << 20
"""Bytes of a request body at most."""
MAX_TOKENS = 1 << 18
"""Token ids in one query at most (a 256k-token prompt)."""
MAX_NAMESPACES = 64
"""Namespaces one ``model`` query may cover (the rest are not asked)."""
MAX_STEPS = 1 << 17
"""Chunk steps (a lookup, and a hash where the chain is not hashed yet) of one query in
all: 64 namespaces of a 256k-token prompt at 256 tokens a chunk need 65,536."""
SLICE_S = 0.002
"""The walk yields to the event loop at least this often (ZeroMQ requests wait no longer)."""


class QueryError(Exception):
    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class _Request:
    tokens: list[int]
    root: bytes
    namespace: str | None
    model: str | None


def _int(text: str) -> int:
    # A Python callback, not ``int`` itself: json.loads is one C call that holds the GIL
    # for its whole run (60-90 ms for a 3 MB body, the event loop stopped meanwhile); the
    # interpreter hands the GIL over between callbacks, so the loop waits ~25 ms at most,
    # for a parse about 3x slower on the worker thread.
    return int(text)


def _parse(body: bytes) -> _Request:
    """The checked request (QueryError 400); run on a worker thread: a 4 MiB body
    of token ids is tens of milliseconds of parsing and checking."""
    try:
        request = json.loads(body, parse_int=_int)
    except (ValueError, UnicodeDecodeError) as err:
        raise QueryError("400 Bad Request", f"the body is not JSON ({err})") from None
    if not isinstance(request, dict):
        raise QueryError("400 Bad Request", "the body must be a JSON object")
    tokens = request.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < 1 << 32 for t in tokens):
        raise QueryError("400 Bad Request", '"tokens" must be a list of token ids (integers 0..2^32-1)')
    if len(tokens) > MAX_TOKENS:
        raise QueryError("400 Bad Request", f'"tokens" holds {len(tokens)} ids; at most {MAX_TOKENS}')
    lora, salt, tags = request.get("lora"), request.get("salt"), request.get("tags", [])
    if not all(v is None or isinstance(v, str) for v in (lora, salt)):
        raise QueryError("400 Bad Request", '"lora" and "salt" must be strings')
    if not isinstance(tags, list) or not all(isinstance(t, str) and t for t in tags):
        raise QueryError("400 Bad Request", '"tags" must be a list of non-empty strings')
    if "chunk_size" in request:
        raise QueryError(
            "400 Bad Request",
            "\"chunk_size\" is not taken from the body: it is the namespace's c<N> field, else the daemon's",
        )
    namespace, model = request.get("namespace"), request.get("model")
    if (namespace is None) == (model is None):
        raise QueryError("400 Bad Request", 'give exactly one of "namespace" and "model" (strings)')
    if namespace is not None and not isinstance(namespace, str):
        raise QueryError("400 Bad Request", '"namespace" must be a string')
    if model is not None and not isinstance(model, str):
        raise QueryError("400 Bad Request", '"model" must be a string')
    root = request_root(lora or None, salt or None, sorted(set(tags)))
    return _Request(tokens, root, namespace, model)


class _Chain:
    """The key chain of one prompt at one chunk size, hashed only as far as asked."""

    def __init__(self, tokens: list[int], size: int, root: bytes):
        self.tokens = tokens
        self.size = size
        self.full = len(tokens) // size
        self.digests: list[bytes] = []
        self._prev = root

    def digest(self, i: int) -> bytes:
        """Chunk ``i``'s key (``i`` < :attr:`full`), the chain hashed up to it."""
        while len(self.digests) <= i:
            start = len(self.digests) * self.size
            self._prev = chain_key(self._prev, self.tokens[start : start + self.size])
            self.digests.append(self._prev)
        return self.digests[i]


class Query:
    """Answers ``POST /query`` bodies from the store's lookup."""

    def __init__(
        self,
        where: Callable[[ChunkKey], str | None],
        namespaces: Callable[[], list[str]],
        chunk_size: int,
        access: QueryAccess,
        remote: Callable[[ChunkKey], bool] | None = None,
    ):
        self.where = where
        self.remote = remote
        """Whether Redis is known to hold a key for this node (None: not known, not counted)."""
        self.namespaces = namespaces
        self.chunk_size = chunk_size
        self.access = access
        self.queries = 0
        self.refused = 0

    def scope(self, authorization: str | None) -> QueryScope:
        """Who asks, from the ``Authorization`` header (QueryError 401/403: refused);
        checked before the body is read."""
        scope = self.access.scope(authorization)
        if scope is None:
            self.refused += 1
            raise QueryError("401 Unauthorized" if self.access.needs_token else "403 Forbidden", self.access.refusal)
        return scope

    async def answer(self, body: bytes, scope: QueryScope) -> dict[str, Any]:
        """The answer to one body for a caller of ``scope`` (QueryError: the status and why)."""
        try:
            if len(body) > MAX_BODY:
                raise QueryError("413 Payload Too Large", f"a query body is at most {MAX_BODY} bytes")
            request = await asyncio.to_thread(_parse, body)
            namespaces = self._namespaces(request, scope)
        except QueryError:
            self.refused += 1
            raise
        self.queries += 1
        chains: dict[int, _Chain] = {}
        steps = MAX_STEPS
        out = []
        for ns in namespaces:
            size = chunk_size_of(ns) or self.chunk_size
            chain = chains.setdefault(size, _Chain(request.tokens, size, request.root))
            entry, used = await self._walk(ns, chain, steps)
            steps -= used
            out.append(entry)
        best = max(out, key=lambda r: (r["prefix_tokens"], r["by_medium"].get("CPU", 0)))
        return {"best": best, "namespaces": out}

    def _namespaces(self, request: _Request, scope: QueryScope) -> list[str]:
        # What the caller may not see is answered as what is not here (same status, same body).
        held = [ns for ns in self.namespaces() if scope.sees(ns)]
        if request.namespace is not None:
            if request.namespace not in held:
                raise QueryError("404 Not Found", f"this node holds nothing of namespace {request.namespace!r}")
            return [request.namespace]
        mine = of_model(held, request.model or "")[:MAX_NAMESPACES]  # _parse: model is set here
        if not mine:
            raise QueryError("404 Not Found", f"this node holds nothing of model {request.model!r}")
        return mine

    async def _walk(self, namespace: str, chain: _Chain, steps: int) -> tuple[dict[str, Any], int]:
        """The leading chunks of ``namespace`` this node holds, up to the first miss or
        ``steps`` lookups, and the lookups taken."""
        by_medium: dict[str, int] = {}
        limit = min(chain.full, steps)
        taken = 0
        paused = time.monotonic()
        while taken < limit:
            if time.monotonic() - paused >= SLICE_S:
                await asyncio.sleep(0)  # let ZeroMQ requests in; the store may change meanwhile
                paused = time.monotonic()
            medium = self._medium(ChunkKey(namespace, chain.digest(taken)))
            taken += 1
            if medium is None:
                break
            by_medium[medium] = by_medium.get(medium, 0) + chain.size
        held = sum(by_medium.values())
        answer: dict[str, Any] = {
            "namespace": namespace,
            "chunk_size": chain.size,
            "prefix_tokens": held,
            "by_medium": by_medium,
        }
        if held == taken * chain.size and taken == steps < chain.full:  # out of steps, not at a miss
            answer["truncated"] = True
        return answer, taken

    def _medium(self, key: ChunkKey) -> str | None:
        """Where this node holds ``key`` (CPU, STORAGE, ..., REMOTE), None: nowhere."""
        tier = self.where(key)
        if tier is not None:
            return MEDIUM.get(tier, tier.upper())
        if self.remote is not None and self.remote(key):
            return REMOTE
        return None

    def stats(self) -> dict[str, int]:
        return {"queries": self.queries, "refused": self.refused}
