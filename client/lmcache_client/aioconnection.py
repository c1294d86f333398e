"""The asyncio client's connection to its daemon: one DEALER socket, many requests in flight.

Requests from many tasks share the socket; one reader task matches each reply
to its request by id.  A request that gets no reply within ``timeout_s`` is
answered by the fail-open breaker (:mod:`lmcache_client.failopen`), and a
zero-copy send still pending then resets the socket.  At most
``max_outstanding`` requests are in flight (the daemon's ROUTER drops replies
past its per-peer high-water mark).

Primitives: :class:`AsyncConnection` (``run``, ``tell``, ``close``, its
``breaker``).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from .calls import Call
from .connection import COPY_THRESHOLD, new_dealer, unavailable
from .errors import DaemonUnavailable
from .handshake import HandshakeWatch
from .options import ClientOptions, request_ids
from .protocol import Reply, decode_reply, encode_request

logger = logging.getLogger("lmcache_client.aio")  # the logger these lines always had
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


class AsyncConnection:
    """The asyncio client's socket (opened on first use), its reader task, the
    requests in flight and the fail-open breaker."""

    def __init__(self, options: ClientOptions, context: zmq.asyncio.Context | None = None):
        self.address = options.address
        self.timeout_s = options.timeout_s
        """A request's timeout unless the call names another (settable)."""
        self.breaker = options.breaker()
        """The fail-open breaker, which also counts failures and BUSY replies."""
        self.closed = False
        self._curve = options.curve
        self._hwm = options.hwm
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._handshakes: HandshakeWatch | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[tuple[Reply, list[Any]]]] = {}
        self._ids = request_ids()
        # The daemon's ROUTER drops replies past its per-peer high-water mark
        # (hello's max_outstanding_requests, 256 by default): stay below it.
        self._slots = asyncio.Semaphore(options.max_outstanding)

    async def close(self) -> None:
        self.closed = True
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
        if self.closed:
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

    async def run(self, call: Call[T], timeout_s: float | None = None) -> T:
        """Send ``call`` and return its parsed answer (fail-open: its miss when the daemon is out)."""
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
            return self.breaker.failed(call, failure)
        return self.breaker.answered(call, reply, payloads)

    async def _abandon(self, tracker: zmq.MessageTracker | None, timeout_s: float) -> None:
        if tracker is None or tracker.done:
            return
        deadline = time.monotonic() + timeout_s
        while not tracker.done and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        if not tracker.done:
            logger.warning("a zero-copy send to %s is still pending; resetting the socket", self.address)
            await self._drop_socket(DaemonUnavailable("socket reset after a stuck send"))

    async def tell(self, call: Call[Any]) -> None:
        """Send without waiting for the reply (the reader drops it)."""
        request_id = next(self._ids) & (2**64 - 1)
        frames = encode_request(call.op, request_id, call.namespace, call.keys, call.payloads, **call.fields)
        try:
            await self._socket().send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            pass  # the lease expires by itself
