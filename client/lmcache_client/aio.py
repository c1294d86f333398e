"""asyncio thin client: many concurrent requests over one DEALER socket.

Primitives: :class:`AsyncCacheClient`, with the same ops and fail-open
behaviour as :class:`~lmcache_client.client.CacheClient` (each op a coroutine).
Replies are matched to requests by id by one reader task, so calls from many
tasks may be in flight at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from . import calls, shm
from .calls import Call, LookupResult
from .client import COPY_THRESHOLD, DEFAULT_ADDRESS, FailOpen, namespace_string, new_dealer, unavailable
from .curve import CurveKeys
from .errors import ClientError, DaemonUnavailable, ServerError
from .handshake import HandshakeWatch
from .keys import chunk_keys
from .namespace import Namespace
from .protocol import PutStatus, Reply, decode_reply, encode_request
from .shm import SharedPool

logger = logging.getLogger(__name__)
T = TypeVar("T")


async def _within(coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
    """``coro``'s result, or asyncio.TimeoutError after ``timeout_s`` (it is cancelled).

    ``asyncio.timeout`` (no extra task) where there is one, 3.11+; ``wait_for``
    on 3.10, which the package supports (client/pyproject.toml).  On 3.10
    asyncio.TimeoutError is not the builtin TimeoutError: callers catch both.
    """
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout_s):
            return await coro
    return await asyncio.wait_for(coro, timeout_s)


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
        self.address = address
        self._curve = CurveKeys.from_options(server_public_key, client_secret_key)  # as CacheClient's
        self.namespace = namespace_string(namespace)
        self.chunk_size = chunk_size or (namespace.chunk_size if isinstance(namespace, Namespace) else None)
        self.timeout_s = timeout_s
        self._hwm = hwm
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._handshakes: HandshakeWatch | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[tuple[Reply, list[Any]]]] = {}
        self._ids = itertools.count(int.from_bytes(os.urandom(4), "little") << 20)
        self._fail = FailOpen(fail_open, address)
        self._closed = False
        self.shared_memory = shared_memory
        # copy_threads: how many threads a large shared-memory copy is split over.
        # staged_puts: a stream of shared-memory puts is one round trip each, into
        # pool slots staged for it (shm.py); False: every put is alloc+commit.
        self._mapping = shm.Mapping(copy_threads, staged_puts)
        # The daemon's ROUTER drops replies past its per-peer high-water mark
        # (hello's max_outstanding_requests, 256 by default): stay below it.
        self._slots = asyncio.Semaphore(max_outstanding)

    async def __aenter__(self) -> AsyncCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def failures(self) -> int:
        return self._fail.failures

    @property
    def busy_replies(self) -> int:
        return self._fail.busy_replies

    async def close(self) -> None:
        pool = self._mapping.pool
        leases = shm.parting(pool) if pool is not None and not self._closed else []
        if leases:  # staged slots and unsettled write leases: freed now, not at their deadline
            try:
                await self._run(calls.release(leases), min(self.timeout_s, 1.0))
            except ClientError:
                pass
        self._unmap()
        self._closed = True
        await self._drop_socket(DaemonUnavailable("client closed"))

    async def _drop_socket(self, err: Exception) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
            self._reader = None
        if self._handshakes is not None:
            self._handshakes.close()
            self._handshakes = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()

    def _socket(self) -> zmq.asyncio.Socket:
        if self._closed:
            raise RuntimeError("client is closed")
        if self._sock is None:
            sock: zmq.asyncio.Socket
            sock, self._handshakes = new_dealer(self._ctx, self.address, self._hwm, self._curve, watch=True)
            self._sock = sock
            self._reader = asyncio.get_running_loop().create_task(self._read_replies(sock))
        return self._sock

    async def _read_replies(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart(copy=False)
            try:
                reply = decode_reply(frames[0].buffer)
            except ValueError:
                logger.warning("dropping a reply that is not protocol v1")
                continue
            if reply.id is None:
                # The daemon could not read a request's id (e.g. a header over its
                # size limit), so the caller will time out; say why.
                logger.warning("daemon refused an unidentifiable request: %s %s", reply.code, reply.message)
                continue
            fut = self._pending.pop(reply.id, None)
            if fut is not None and not fut.done():
                fut.set_result((reply, [f.buffer for f in frames[1:]]))

    async def _run(self, call: Call[T], timeout_s: float | None = None) -> T:
        async with self._slots:
            return await self._run_one(call, timeout_s)

    async def _run_one(self, call: Call[T], timeout_s: float | None = None) -> T:
        timeout = timeout_s or self.timeout_s
        request_id = next(self._ids) & (2**64 - 1)
        frames = encode_request(call.op, request_id, call.namespace, call.keys, call.payloads, **call.fields)
        big = any(memoryview(f).nbytes >= COPY_THRESHOLD for f in frames[1:])
        sock = self._socket()
        fut: asyncio.Future[tuple[Reply, list[Any]]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = fut
        sent: list[zmq.MessageTracker | None] = []

        async def exchange() -> tuple[Reply, list[Any]]:
            # Waits while there is no connection (IMMEDIATE) or the HWM is reached.
            sent.append(await sock.send_multipart(frames, copy=not big, track=big))
            return await fut

        try:
            reply, payloads = await _within(exchange(), timeout)
        except (asyncio.TimeoutError, TimeoutError, DaemonUnavailable) as err:
            self._pending.pop(request_id, None)
            await self._abandon(sent[0] if sent else None, timeout)
            failure = (
                err
                if isinstance(err, DaemonUnavailable)
                else unavailable(f"no reply from {self.address} within {timeout}s", self._handshakes)
            )
            return self._fail.failed(call, failure)
        return self._fail.answered(call, reply, payloads)

    async def _abandon(self, tracker: zmq.MessageTracker | None, timeout_s: float) -> None:
        if tracker is None or tracker.done:
            return
        deadline = time.monotonic() + timeout_s
        while not tracker.done and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        if not tracker.done:
            logger.warning("a zero-copy send to %s is still pending; resetting the socket", self.address)
            await self._drop_socket(DaemonUnavailable("socket reset after a stuck send"))

    def _ns(self, namespace: Namespace | str | None) -> str:
        ns = namespace_string(namespace) or self.namespace
        if not ns:
            raise ValueError("no namespace: pass namespace= here or to the client")
        return ns

    # -- shared memory (see shm.py; the same flows as CacheClient) -----------------
    async def uses_shared_memory(self) -> bool:
        try:
            return await self._shared_pool() is not None
        except DaemonUnavailable:
            return False

    async def _shared_pool(self) -> SharedPool | None:
        if not self.shared_memory:
            return None
        if not self._mapping.probed:
            try:
                offer = (await self._run(calls.hello("lmcache-client-py-async"))).get("shm")
            except ServerError:
                offer = None
            return self._mapping.adopt(offer)  # another task may have probed meanwhile: kept
        return self._mapping.pool

    @property
    def _pool(self) -> SharedPool | None:
        return self._mapping.pool

    def _unmap(self) -> None:
        self._mapping.drop()

    async def _tell(self, call: Call[Any]) -> None:
        request_id = next(self._ids) & (2**64 - 1)
        frames = encode_request(call.op, request_id, call.namespace, call.keys, call.payloads, **call.fields)
        try:
            await self._socket().send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            pass  # the lease expires by itself

    async def _drive(self, flow: shm.Flow) -> Any:
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = flow.throw(error) if error is not None else flow.send(value)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            if isinstance(step, shm.Tell):
                await self._tell(step.call)
            else:
                try:
                    value = await self._run(step.call)
                except (ClientError, asyncio.CancelledError) as err:  # into the flow: it may clean up
                    error = err

    async def _over_shm(
        self,
        flow: Callable[[SharedPool], shm.Flow],
        fallback: Callable[[], Awaitable[T]],
        miss: Callable[[], T],
    ) -> T:
        for _ in range(2):
            try:
                pool = await self._shared_pool()
                if pool is None:
                    return await fallback()
                result: T = await self._drive(flow(pool))
                return result
            except (ServerError, DaemonUnavailable) as err:
                action = shm.on_failure(err, self._fail.enabled)
                if action == shm.REMAP:
                    self._unmap()
                    continue
                if action == shm.MISS:
                    return miss()
                raise
        return await fallback()

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
        return await self._over_shm(
            lambda pool: shm.put_flow(pool, ns, keys, payloads, tokens),
            lambda: self._run(call),
            lambda: [PutStatus.FAILED] * len(keys),
        )

    async def get(self, keys: Sequence[bytes], *, namespace: Namespace | str | None = None) -> list[Any | None]:
        ns = self._ns(namespace)
        return await self._over_shm(
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

        return await self._over_shm(lambda pool: shm.get_flow(pool, ns, keys, out), frames, lambda: [False] * len(keys))

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
