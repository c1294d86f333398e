"""``POST /query`` on the metrics HTTP port: token ids -> the longest prefix this node
holds, in tokens, and how much of it each medium holds (docs/events.md, "Query").

For a router without an indexer (Mooncake's Conductor asks the same question
over HTTP): the answer is the store's own (the fastest local tier of each key,
as ``lookup`` finds it), never a copy that could lag.

Request (JSON, at most :data:`MAX_BODY` bytes, :data:`MAX_TOKENS` ids):
``{"tokens": [int...], "namespace": NS}`` or ``{"tokens": [...], "model": M}``
(every namespace of model ``M`` this node holds), optional ``"lora"``,
``"salt"``, ``"tags"`` (the chain root, as the vLLM connector names it:
``keys.request_root``: tags sorted, each part only when given) and ``"chunk_size"`` (else the
namespace's ``c<N>`` field, else the daemon's).

Answer: ``{"best": {...}, "namespaces": [{"namespace", "chunk_size",
"prefix_tokens", "by_medium": {"CPU": n, "STORAGE": n}}]}`` (``prefix_tokens``:
the leading full chunks that some local tier holds, times the chunk size;
``by_medium``: how many of those tokens each medium holds).  Redis is not
asked (no round trip): with ``events_remote`` the prefix goes on through the
chunks this node knows Redis holds for it, as the events announce them
(locality REMOTE, :mod:`..events.remote`), counted as ``"REMOTE"``.

Errors: 400 (not JSON, a field of the wrong type, too many tokens), 403 (the
daemon has ``auth: curve`` and not ``allow_insecure``: HTTP carries no client
identity to check a tenant grant against), 404 (no such namespace or model on
this node), 413 (a body over :data:`MAX_BODY`).

Primitives: :class:`QueryError`, :class:`Query`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from lmcache_client.keys import chunk_keys, request_root

from ..events.announcer import MEDIUM
from ..events.remote import REMOTE
from ..storage.base import ChunkKey

MAX_BODY = 4 << 20
"""Bytes of a request body at most."""
MAX_TOKENS = 1 << 18
"""Token ids in one query at most (a 256k-token prompt)."""
MAX_NAMESPACES = 64
"""Namespaces one ``model`` query may cover (the rest are not asked)."""


class QueryError(Exception):
    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


def _chunk_size_of(namespace: str) -> int | None:
    for field in namespace.split("|"):
        if len(field) > 1 and field[0] == "c" and field[1:].isdigit():
            return int(field[1:])
    return None


class Query:
    """Answers ``POST /query`` bodies from the store's lookup."""

    def __init__(
        self,
        where: Callable[[ChunkKey], str | None],
        namespaces: Callable[[], list[str]],
        chunk_size: int,
        allowed: bool,
        remote: Callable[[ChunkKey], bool] | None = None,
    ):
        self.where = where
        self.remote = remote
        """Whether Redis is known to hold a key for this node (None: not known, not counted)."""
        self.namespaces = namespaces
        self.chunk_size = chunk_size
        self.allowed = allowed
        self.queries = 0
        self.refused = 0

    def answer(self, body: bytes) -> dict[str, Any]:
        """The answer to one body (QueryError: the status and why)."""
        try:
            return self._answer(body)
        except QueryError:
            self.refused += 1
            raise

    def _answer(self, body: bytes) -> dict[str, Any]:
        if not self.allowed:
            raise QueryError(
                "403 Forbidden",
                "auth: curve is on and HTTP carries no client identity: /query is served only with "
                "allow_insecure: true (ask with the lookup op over the authenticated socket instead)",
            )
        if len(body) > MAX_BODY:
            raise QueryError("413 Payload Too Large", f"a query body is at most {MAX_BODY} bytes")
        try:
            request = json.loads(body)
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
        chunk_size = request.get("chunk_size")
        if chunk_size is not None and (type(chunk_size) is not int or not 1 <= chunk_size <= MAX_TOKENS):
            raise QueryError("400 Bad Request", f'"chunk_size" must be an integer 1..{MAX_TOKENS}')
        namespaces = self._namespaces(request)
        root = request_root(lora or None, salt or None, sorted(set(tags)))
        self.queries += 1
        out = [self._one(ns, tokens, root, chunk_size) for ns in namespaces]
        best = max(out, key=lambda r: (r["prefix_tokens"], r["by_medium"].get("CPU", 0)))
        return {"best": best, "namespaces": out}

    def _namespaces(self, request: dict[str, Any]) -> list[str]:
        namespace, model = request.get("namespace"), request.get("model")
        if (namespace is None) == (model is None):
            raise QueryError("400 Bad Request", 'give exactly one of "namespace" and "model" (strings)')
        held = self.namespaces()
        if namespace is not None:
            if not isinstance(namespace, str):
                raise QueryError("400 Bad Request", '"namespace" must be a string')
            if namespace not in held:
                raise QueryError("404 Not Found", f"this node holds nothing of namespace {namespace!r}")
            return [namespace]
        if not isinstance(model, str):
            raise QueryError("400 Bad Request", '"model" must be a string')
        mine = [ns for ns in held if ns.split("|", 1)[0] == model][:MAX_NAMESPACES]
        if not mine:
            raise QueryError("404 Not Found", f"this node holds nothing of model {model!r}")
        return mine

    def _one(self, namespace: str, tokens: list[int], root: bytes, chunk_size: int | None) -> dict[str, Any]:
        size = chunk_size or _chunk_size_of(namespace) or self.chunk_size
        by_medium: dict[str, int] = {}
        n = 0
        for digest in chunk_keys(tokens, size, root):
            key = ChunkKey(namespace, digest)
            tier = self.where(key)
            if tier is not None:
                medium = MEDIUM.get(tier, tier.upper())
            elif self.remote is not None and self.remote(key):
                medium = REMOTE
            else:
                break
            by_medium[medium] = by_medium.get(medium, 0) + size
            n += size
        return {"namespace": namespace, "chunk_size": size, "prefix_tokens": n, "by_medium": by_medium}

    def stats(self) -> dict[str, int]:
        return {"queries": self.queries, "refused": self.refused}
