"""Request handlers: one function per op, from a validated Request to an Outcome.

Handlers never touch sockets.  They return the reply fields and, for get,
the leased chunks to send; the server releases those once ZeroMQ has sent
them.  Refusals are raised as ProtocolError and become one error reply.

The shared-memory ops (a get under a read lease, alloc, commit, bind,
release) are a part :class:`Handlers` builds and holds: :class:`.shm.ShmOps`
(shm/ops.py); what a handler returns, :class:`Outcome`, is in outcome.py
(importable from here).
A lookup with ``prefetch: true`` starts its prefetch once its reply is sent
(prefetch.py); one with ``cancel_prefetch: true`` gives up the prefetches of its keys.
The operator's ``pin`` and ``prefetch`` ops are in cacheapi.py.

Primitives: :class:`Handlers` (``handle``) and :class:`Outcome`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from lmcache_client.protocol import KEY_BYTES, PROTOCOL_VERSION, ErrorCode, Op, ProtocolError, Request

from .. import __version__
from ..config import ServerConfig
from ..storage import TieredStore
from .cacheapi import CacheApi
from .inflight import ByteBudget
from .outcome import Outcome, namespace_of, reply_cap
from .prefetch import Prefetcher, cancel_flag, owner_of, prefetch_flag
from .shm import STAGED_SHARE, ShmLeases, ShmOps
from .tokens import parse_tokens

__all__ = ["STAGED_SHARE", "Handlers", "Outcome"]


class Handlers:
    """One method per op; the ops of its parts: ``cache_api`` (pin, prefetch) and
    ``shm_ops`` (a get under a read lease, alloc, commit, bind, release)."""

    def __init__(
        self,
        store: TieredStore,
        config: ServerConfig,
        budget: ByteBudget,
        shm: ShmLeases | None = None,
        prefetcher: Prefetcher | None = None,
    ):
        self.store = store
        self.config = config
        self.budget = budget
        self.prefetcher = prefetcher if prefetcher is not None else Prefetcher(store, budget)
        """Promotes the lower-tier hits of lookups with ``prefetch: true`` (prefetch.py)."""
        self.cache_api = CacheApi(store, self.prefetcher, config.max_pinned_fraction)
        """The operator's ``pin`` (promotion, bound) and ``prefetch`` ops (cacheapi.py)."""
        self.shm = shm if shm is not None and shm.enabled else None
        self.shm_ops = ShmOps(store, config, budget, self.shm)
        """The shared-memory ops: get under a read lease, alloc, commit, bind, release (shm/ops.py)."""
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
            Op.PIN: self.cache_api.pin,
            Op.PREFETCH: self.cache_api.prefetch,
            Op.UNPIN: self.unpin,
            Op.STATS: self.stats,
            Op.ALLOC: self.shm_ops.alloc,
            Op.COMMIT: self.shm_ops.commit,
            Op.RELEASE: self.shm_ops.release,
            Op.BIND: self.shm_ops.bind,
        }

    async def handle(
        self, request: Request, reply_share: Callable[[], int] | None = None, peer: bytes = b""
    ) -> Outcome:
        """Answer ``request``; ``reply_share()`` says how many reply payload bytes
        the requesting connection may take now (its fair share, see inflight.py);
        ``peer``: the connection's routing id (whose prefetches a lookup joins or cancels)."""
        if request.op is Op.GET:
            return await self.get(request, reply_share)
        if request.op is Op.LOOKUP:
            return await self.lookup(request, peer)
        return await self._table[request.op](request)

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
                "shm": self.shm.offer() if self.shm is not None else None,
                # KV events on: puts may carry token ids (server/tokens.py, docs/events.md)
                "events": {"block_size": c.events_block_size, "tokens_frame": True}
                if c.events_endpoint is not None
                else None,
                # the KV codec clients encode with (kv_codec / remote_serde; docs/codec.md); None: raw chunks
                "codec": c.codec.to_dict() if c.codec is not None else None,
                # lookup takes ``prefetch: true`` (docs/protocol.md 5.5)
                "prefetch": True,
                # ... and ``cancel_prefetch: true`` (a request given up before its load)
                "prefetch_cancel": True,
            }
        )

    async def ping(self, request: Request) -> Outcome:
        return Outcome({"time": time.time()})

    async def put(self, request: Request) -> Outcome:
        tokens = parse_tokens(request)
        statuses, finish = await self.store.prepare_puts(namespace_of(request), request.keys, request.payloads, tokens)
        return Outcome({"status": [int(s) for s in statuses]}, after_reply=finish)

    async def get(self, request: Request, reply_share: Callable[[], int] | None = None) -> Outcome:
        if request.fields.get("shm") is not None:
            return await self.shm_ops.get(request, reply_share)
        chunks = await self.store.get_many(namespace_of(request), request.keys)
        # A reply's payload bytes never exceed max_message_size, nor the
        # connection's fair share of the budget: hits past it are answered as
        # misses (the client recomputes them, or asks again).
        cap = reply_cap(self.config.max_message_size, reply_share)
        total = trimmed = 0
        for i, chunk in enumerate(chunks):
            if chunk is None:
                continue
            if total + chunk.nbytes > cap:
                chunk.release()
                chunks[i] = None
                trimmed += total + chunk.nbytes <= self.config.max_message_size
            else:
                total += chunk.nbytes
        hits = [c for c in chunks if c is not None]
        if (trimmed and not hits) or not self.budget.try_acquire(total):
            for chunk in hits:
                chunk.release()
            raise ProtocolError(ErrorCode.BUSY, "in-flight byte budget spent; retry", request.id)
        return Outcome({"found": [c is not None for c in chunks]}, hits, total, trimmed=trimmed)

    async def lookup(self, request: Request, peer: bytes = b"") -> Outcome:
        self._cancel(request, peer)
        prefetch = prefetch_flag(request)
        hits, tiers = await self.store.lookup(namespace_of(request), request.keys)
        return self._looked_up(request, hits, tiers, prefetch, peer)

    def _cancel(self, request: Request, peer: bytes) -> None:
        """``cancel_prefetch: true``: give up the prefetches this connection's lookup
        of the same keys joined (never another request's)."""
        if cancel_flag(request):
            self.prefetcher.cancel(namespace_of(request), request.keys, owner_of(peer, request.keys))

    def lookup_now(self, request: Request, peer: bytes = b"") -> Outcome | None:
        """A lookup answered in the receive loop, without a task (None: it must
        wait for Redis; use :meth:`handle`)."""
        self._cancel(request, peer)
        prefetch = prefetch_flag(request)
        found = self.store.lookup_now(namespace_of(request), request.keys)
        return None if found is None else self._looked_up(request, *found, prefetch, peer)

    def _looked_up(self, request: Request, hits: int, tiers: list[str | None], prefetch: bool, peer: bytes) -> Outcome:
        outcome = Outcome({"hits": hits, "tiers": tiers})
        memory = self.store.memory.name
        if prefetch and any(t != memory for t in tiers[:hits]):
            # After the reply: the engine learns what is cached first, then the lower
            # tiers' chunks move up while its request is parked.
            namespace, keys, found = namespace_of(request), request.keys[:hits], tiers[:hits]
            owner = owner_of(peer, request.keys)  # all its keys: what its cancel will send

            def start() -> None:
                self.prefetcher.start(namespace, keys, found, owner)

            outcome.after_reply = start
        return outcome

    async def exists(self, request: Request) -> Outcome:
        return Outcome({"exists": await self.store.exists(namespace_of(request), request.keys)})

    async def delete(self, request: Request) -> Outcome:
        return Outcome({"deleted": await self.store.delete(namespace_of(request), request.keys)})

    async def clear(self, request: Request) -> Outcome:
        if request.namespace is None and request.fields.get("all") is not True:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "clear needs 'ns' or 'all': true", request.id)
        return Outcome({"removed": await self.store.clear(request.namespace)})

    async def unpin(self, request: Request) -> Outcome:
        return Outcome({"unpinned": await self.store.unpin(namespace_of(request), request.keys)})

    async def stats(self, request: Request) -> Outcome:
        stats = self.store.stats(request.namespace)
        stats["server"] = {
            "version": __version__,
            "uptime_s": round(time.time() - self.started_at, 3),
            "inflight_bytes": self.budget.in_use,
            "max_inflight_bytes": self.budget.max_bytes,
            "chunk_size": self.config.chunk_size,
        }
        stats["prefetch"] = self.prefetcher.stats()
        if self.shm is not None:
            stats["shm"] = self.shm.stats()
        return Outcome({"stats": stats})
