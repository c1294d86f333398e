"""asyncio thin client: many concurrent requests over one DEALER socket.

Primitives: :class:`AsyncCacheClient`, with the same ops and fail-open
behaviour as :class:`~lmcache_client.client.CacheClient` (each op a coroutine).
Replies are matched to requests by id by one reader task, so calls from many
tasks may be in flight at once.

Like the sync client it is a front object built from one
:class:`~lmcache_client.options.ClientOptions`: its transport
(:class:`~lmcache_client.aioconnection.AsyncConnection`) and its same-host
path (:class:`~lmcache_client.shm.AsyncSharedMemoryPath`, the same flows and
flow stepping as the sync client's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import zmq.asyncio

from . import calls, shm
from .aioconnection import AsyncConnection
from .calls import Call, LookupResult
from .connection import DEFAULT_ADDRESS, namespace_string
from .keys import chunk_keys
from .namespace import Namespace
from .options import ClientOptions
from .protocol import PutStatus
from .shm import AsyncSharedMemoryPath, SharedPool

T = TypeVar("T")


class AsyncCacheClient:
    """Non-blocking client of one daemon; use ``async with`` or call ``close()``."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        namespace: Namespace | str | None = None,
        *,
        timeout_s: float = 5.0,
        fail_open: bool = True,
        chunk_size: int | None = None,
        hwm: int = 64,
        max_outstanding: int = 128,
        context: zmq.asyncio.Context | None = None,
        shared_memory: bool = True,
        copy_threads: int = 2,
        staged_puts: bool = True,
        server_public_key: str | None = None,
        client_secret_key: str | None = None,
    ):
        options = ClientOptions.parse(
            address,
            namespace,
            timeout_s=timeout_s,
            fail_open=fail_open,
            chunk_size=chunk_size,
            hwm=hwm,
            shared_memory=shared_memory,
            copy_threads=copy_threads,
            staged_puts=staged_puts,
            server_public_key=server_public_key,
            client_secret_key=client_secret_key,
            client_name="lmcache-client-py-async",
            max_outstanding=max_outstanding,
        )
        self.address = options.address
        self.namespace = options.namespace
        self.chunk_size = options.chunk_size
        self._conn = AsyncConnection(options, context)
        self._shm = AsyncSharedMemoryPath(options, self._conn)

    async def __aenter__(self) -> AsyncCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._shm.let_go()
        self._shm.unmap()
        await self._conn.close()

    # -- the parts, as the client's callers see them -------------------------------
    @property
    def timeout_s(self) -> float:
        """A request's timeout (settable)."""
        return self._conn.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._conn.timeout_s = value

    @property
    def shared_memory(self) -> bool:
        return self._shm.enabled

    @shared_memory.setter
    def shared_memory(self, value: bool) -> None:
        self._shm.enabled = value

    @property
    def failures(self) -> int:
        return self._conn.breaker.failures

    @property
    def busy_replies(self) -> int:
        return self._conn.breaker.busy_replies

    async def uses_shared_memory(self) -> bool:
        return await self._shm.uses_shared_memory()

    async def _run(self, call: Call[T], timeout_s: float | None = None) -> T:
        return await self._conn.run(call, timeout_s)

    async def _shared_pool(self) -> SharedPool | None:
        return await self._shm.shared_pool()

    @property
    def _pool(self) -> SharedPool | None:
        return self._shm.pool

    def _ns(self, namespace: Namespace | str | None) -> str:
        ns = namespace_string(namespace) or self.namespace
        if not ns:
            raise ValueError("no namespace: pass namespace= here or to the client")
        return ns

    # -- ops (see CacheClient for their meaning) -----------------------------------
    async def hello(self, client_name: str = "lmcache-client-py-async") -> dict[str, Any]:
        return await self._run(calls.hello(client_name))

    async def ping(self, timeout_s: float | None = None) -> float:
        return await self._run(calls.ping(), timeout_s)

    async def put(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[Any],
        *,
        namespace: Namespace | str | None = None,
        tokens: calls.TokensArg = None,
    ) -> list[PutStatus | int]:
        """As :meth:`CacheClient.put <lmcache_client.client.CacheClient.put>` (``tokens`` included)."""
        ns = self._ns(namespace)
        call = calls.put(ns, keys, payloads, tokens)
        if sum(memoryview(p).nbytes for p in payloads) < shm.PUT_MIN_BYTES:
            return await self._run(call)
        return await self._shm.over_shm(
            lambda pool: shm.put_flow(pool, ns, keys, payloads, tokens),
            lambda: self._run(call),
            lambda: [PutStatus.FAILED] * len(keys),
        )

    async def get(self, keys: Sequence[bytes], *, namespace: Namespace | str | None = None) -> list[Any | None]:
        ns = self._ns(namespace)
        return await self._shm.over_shm(
            lambda pool: shm.get_flow(pool, ns, keys, None),
            lambda: self._run(calls.get(ns, keys)),
            lambda: [None] * len(keys),
        )

    async def get_into(
        self, keys: Sequence[bytes], out: Sequence[Any], *, namespace: Namespace | str | None = None
    ) -> list[bool]:
        """Copy each hit into ``out[i]`` (tensor or writable buffer); True where it was a hit."""
        ns = self._ns(namespace)
        if len(out) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(out)} destinations")

        async def frames() -> list[bool]:
            bufs = await self._run(calls.get(ns, keys))
            return [buf is not None and shm.copy_frame(buf, dest) for dest, buf in zip(out, bufs)]

        return await self._shm.over_shm(
            lambda pool: shm.get_flow(pool, ns, keys, out), frames, lambda: [False] * len(keys)
        )

    async def lookup(
        self,
        keys: Sequence[bytes],
        *,
        namespace: Namespace | str | None = None,
        prefetch: bool = False,
        cancel_prefetch: bool = False,
    ) -> LookupResult:
        """As :meth:`.client.CacheClient.lookup`."""
        return await self._run(
            calls.lookup(self._ns(namespace), keys, prefetch=prefetch, cancel_prefetch=cancel_prefetch)
        )

    async def lookup_tokens(self, tokens: Sequence[int], *, namespace: Namespace | str | None = None) -> int:
        if self.chunk_size is None:
            raise ValueError("lookup_tokens needs chunk_size (pass it or a Namespace to the client)")
        keys = chunk_keys(tokens, self.chunk_size)
        if not keys:
            return 0
        return (await self.lookup(keys, namespace=namespace)).hit_chunks * self.chunk_size

    async def exists(self, keys: Sequence[bytes], *, namespace: Namespace | str | None = None) -> list[bool]:
        return await self._run(calls.exists(self._ns(namespace), keys))

    async def delete(self, keys: Sequence[bytes], *, namespace: Namespace | str | None = None) -> list[bool]:
        return await self._run(calls.delete(self._ns(namespace), keys))

    async def pin(self, keys: Sequence[bytes], *, namespace: Namespace | str | None = None) -> list[bool]:
        return await self._run(calls.pin(self._ns(namespace), keys))

    async def unpin(self, keys: Sequence[bytes], *, namespace: Namespace | str | None = None) -> list[bool]:
        return await self._run(calls.unpin(self._ns(namespace), keys))

    async def prefetch(
        self, keys: Sequence[bytes], *, namespace: Namespace | str | None = None
    ) -> calls.PrefetchResult:
        """Promote these chunks from disk or Redis into memory now (the operator's cache API)."""
        return await self._run(calls.prefetch(self._ns(namespace), keys))

    async def clear(self, *, namespace: Namespace | str | None = None, all_namespaces: bool = False) -> int:
        return await self._run(calls.clear(None if all_namespaces else self._ns(namespace)))

    async def stats(self, *, namespace: Namespace | str | None = None) -> dict[str, Any]:
        return await self._run(calls.stats(namespace_string(namespace)))
