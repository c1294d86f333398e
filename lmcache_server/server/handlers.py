"""Request handlers: one function per op, from a validated Request to an Outcome.

Handlers never touch sockets.  They return the reply fields and, for get,
the leased chunks to send; the server releases those once ZeroMQ has sent
them.  Refusals are raised as ProtocolError and become one error reply.

Primitives: :class:`Handlers` (``handle``) and :class:`Outcome`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

from lmcache_client.protocol import KEY_BYTES, PROTOCOL_VERSION, ErrorCode, Op, ProtocolError, Request

from .. import __version__
from ..config import ServerConfig
from ..storage import Chunk, TieredStore
from .admission import ByteBudget


@dataclasses.dataclass
class Outcome:
    fields: dict[str, Any]
    chunks: list[Chunk] = dataclasses.field(default_factory=list)
    budget_bytes: int = 0
    """Bytes taken from the budget for the reply; released once it is sent."""
    after_reply: Callable[[], None] | None = None
    """Work to finish right after the reply is queued, before any other request
    runs (a put's copy into the pool: it overlaps the client's next transfer)."""


class Handlers:
    def __init__(self, store: TieredStore, config: ServerConfig, budget: ByteBudget):
        self.store = store
        self.config = config
        self.budget = budget
        self.started_at = time.time()
        self._table: dict[Op, Callable[[Request], Awaitable[Outcome]]] = {
            Op.HELLO: self.hello,
            Op.PING: self.ping,
            Op.PUT: self.put,
            Op.GET: self.get,
            Op.LOOKUP: self.lookup,
            Op.EXISTS: self.exists,
            Op.DELETE: self.delete,
            Op.CLEAR: self.clear,
            Op.PIN: self.pin,
            Op.UNPIN: self.unpin,
            Op.STATS: self.stats,
        }

    async def handle(self, request: Request) -> Outcome:
        return await self._table[request.op](request)

    @staticmethod
    def _ns(request: Request) -> str:
        assert request.namespace is not None  # decode_request guarantees it for data ops
        return request.namespace

    async def hello(self, request: Request) -> Outcome:
        c = self.config
        return Outcome(
            {
                "server": "lmcache-server",
                "server_version": __version__,
                "protocol_version": PROTOCOL_VERSION,
                "ops": [op.value for op in Op],
                "key_bytes": KEY_BYTES,
                "chunk_size": c.chunk_size,
                "max_message_bytes": c.max_message_size,
                "max_keys_per_request": c.max_keys_per_request,
                "max_outstanding_requests": c.zmq_hwm,
                "save_decode_cache": c.save_decode_cache,
                "tiers": [t.name for t in self.store.tiers],
            }
        )

    async def ping(self, request: Request) -> Outcome:
        return Outcome({"time": time.time()})

    async def put(self, request: Request) -> Outcome:
        statuses, finish = self.store.prepare_puts(self._ns(request), request.keys, request.payloads)
        return Outcome({"status": [int(s) for s in statuses]}, after_reply=finish)

    async def get(self, request: Request) -> Outcome:
        chunks = await self.store.get_many(self._ns(request), request.keys)
        # A reply's payload bytes never exceed max_message_size: hits past it are
        # answered as misses (the client recomputes them).
        total = 0
        for i, chunk in enumerate(chunks):
            if chunk is None:
                continue
            if total + chunk.nbytes > self.config.max_message_size:
                chunk.release()
                chunks[i] = None
            else:
                total += chunk.nbytes
        hits = [c for c in chunks if c is not None]
        if not self.budget.try_acquire(total):
            for chunk in hits:
                chunk.release()
            raise ProtocolError(ErrorCode.BUSY, "in-flight byte budget spent; retry", request.id)
        return Outcome({"found": [c is not None for c in chunks]}, hits, total)

    async def lookup(self, request: Request) -> Outcome:
        hits, tiers = await self.store.lookup(self._ns(request), request.keys)
        return Outcome({"hits": hits, "tiers": tiers})

    async def exists(self, request: Request) -> Outcome:
        return Outcome({"exists": await self.store.exists(self._ns(request), request.keys)})

    async def delete(self, request: Request) -> Outcome:
        return Outcome({"deleted": await self.store.delete(self._ns(request), request.keys)})

    async def clear(self, request: Request) -> Outcome:
        if request.namespace is None and request.fields.get("all") is not True:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "clear needs 'ns' or 'all': true", request.id)
        return Outcome({"removed": await self.store.clear(request.namespace)})

    async def pin(self, request: Request) -> Outcome:
        return Outcome({"pinned": self.store.pin(self._ns(request), request.keys)})

    async def unpin(self, request: Request) -> Outcome:
        return Outcome({"unpinned": self.store.unpin(self._ns(request), request.keys)})

    async def stats(self, request: Request) -> Outcome:
        stats = self.store.stats(request.namespace)
        stats["server"] = {
            "version": __version__,
            "uptime_s": round(time.time() - self.started_at, 3),
            "inflight_bytes": self.budget.in_use,
            "max_inflight_bytes": self.budget.max_bytes,
            "chunk_size": self.config.chunk_size,
        }
        return Outcome({"stats": stats})
