"""The ZeroMQ front end: one ROUTER socket, one event loop, exactly one reply per request.

Flow per message: receive at most ``max_keys_per_request + 1`` frames (the
rest are drained and dropped: TOO_LARGE) -> split the envelope -> decode and
validate the header (errors become error replies) -> access check (with
``auth: curve``: the connection's client name against the op and namespace;
FORBIDDEN) -> in-flight limits (the client's own request and byte limits, then the
server's byte budget and task cap; BUSY when spent) -> a handler task -> one
reply.  A lookup that local tiers answer is answered in the receive loop
itself, without a task.  Every refused limit is counted in
``lmcache_limit_violations_total``.  Get replies send chunk bytes straight from
the memory pool (zero-copy, outgoing.py); each chunk stays leased, and its
bytes stay counted against the budget (and the client's share), until ZeroMQ
reports the send done.

Lifecycle: :meth:`bind` -> :meth:`serve` (until cancelled) -> :meth:`drain`
(answer SHUTTING_DOWN to newcomers while in-flight requests finish) ->
:meth:`close`.

This module owns the socket, the receive loop and that lifecycle; the server
builds and holds two parts: :class:`.dispatch.Dispatch` (from a message to a
handler task and its reply) and :class:`.replies.Replies` (encoding and sending
replies), which share :class:`.outgoing.SentReplies` (zero-copy replies still
being sent) and read the receive loop's state (:class:`.replies.Receiving`).
Primitives: :class:`ZmqServer`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, cast

import zmq
import zmq.asyncio

from ..config import ConfigError, ServerConfig
from ..metrics import ServerMetrics
from ..security import Security
from ..supervisor import Supervisor
from .dispatch import MAX_CONCURRENT_REQUESTS as MAX_CONCURRENT_REQUESTS  # re-exported: docs/protocol.md names it
from .dispatch import Dispatch
from .dispatch import split_envelope as split_envelope
from .handlers import Handlers
from .inflight import ByteBudget
from .outgoing import SentReplies
from .replies import _NOBLOCK, _POLLIN, Receiving, Replies, _events
from .replies import ZERO_COPY_THRESHOLD as ZERO_COPY_THRESHOLD

logger = logging.getLogger(__name__)

RECV_BURST = 64
"""Requests dispatched back to back before the receive loop lets their handlers run."""
HARD_FRAME_LIMIT_FACTOR = 2
"""libzmq drops the connection of a peer sending one frame larger than this
many times max_message_size (it must not even allocate it); frames between
1x and 2x get a TOO_LARGE error reply."""


class ZmqServer:
    """The socket, its receive loop and lifecycle; the parts: :attr:`dispatch`, :attr:`replies`."""

    def __init__(
        self,
        config: ServerConfig,
        handlers: Handlers,
        budget: ByteBudget,
        metrics: ServerMetrics,
        context: zmq.asyncio.Context,
        security: Security | None = None,
        supervisor: Supervisor | None = None,
    ):
        self.config = config
        self.context = context
        self.supervisor = supervisor if supervisor is not None else Supervisor()
        security = security if security is not None else Security(config, None, None)
        self.security = security
        self.sent = SentReplies(budget)
        """Zero-copy replies still being sent (their chunks stay leased until then)."""
        self.receiving = Receiving()
        """The receive loop's socket and state, which sending reads."""
        self.replies = Replies(self.receiving, budget, metrics, self.sent, self._schedule_receive)
        self.dispatch = Dispatch(config, handlers, budget, metrics, security, self.supervisor, self.replies, self.sent)
        self.sock: zmq.asyncio.Socket | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._again = False  # the reader callback is scheduled to run again

    # -- lifecycle -----------------------------------------------------------------
    def bind(self) -> None:
        sock = self.context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.RCVHWM, self.config.zmq_hwm)
        sock.setsockopt(zmq.SNDHWM, self.config.zmq_hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_size * HARD_FRAME_LIMIT_FACTOR)
        sock.setsockopt(zmq.IPV6, 1)
        # Heartbeats drop dead peers, which frees replies (and leases) queued to them.
        sock.setsockopt(zmq.HEARTBEAT_IVL, 5_000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 30_000)
        sock.setsockopt(zmq.LINGER, 0)
        self.security.configure_socket(sock)
        for address in self.config.listen:
            try:
                sock.bind(address)
            except zmq.ZMQError as err:
                sock.close(linger=0)
                expected = (
                    "a free address (port already in use)"
                    if err.errno == zmq.EADDRINUSE
                    else (f"an address this host can bind ({err.strerror})")
                )
                raise ConfigError("listen", address, expected) from None
        self.sock = sock
        self.receiving.rx = zmq.Socket.shadow(sock.underlying)

    async def serve(self) -> None:
        """Receive and dispatch requests until cancelled.

        The socket's fd reader does the receiving, in the event loop's own
        callback (no coroutine hop per wake-up); this coroutine installs it and
        re-raises what broke it."""
        assert self.sock is not None, "bind() first"
        if self._sweeper is None:
            self._sweeper = self.supervisor.spawn("reply_sweeper", self.sent.run)
        receiving = self.receiving
        assert receiving.rx is not None
        loop = asyncio.get_running_loop()
        broken: asyncio.Future[None] = loop.create_future()
        self._loop = loop
        receiving.broken = broken
        fd = cast(int, receiving.rx.getsockopt(zmq.FD))
        loop.add_reader(fd, self._on_readable)
        try:
            self._on_readable()  # what queued before the reader was installed
            await broken
        finally:
            # A serve() started after this one was cancelled (drain's) owns the reader now.
            if receiving.broken is broken:
                receiving.broken = None
                if receiving.rx is not None:
                    loop.remove_reader(fd)

    def _on_readable(self) -> None:
        """Receive and dispatch what is queued, at most RECV_BURST requests per call
        (then again after the handlers made ready meanwhile)."""
        self._again = False
        receiving = self.receiving
        rx = receiving.rx
        broken = receiving.broken
        if rx is None or broken is None or broken.done():
            return
        dispatch = self.dispatch
        receiving.in_callback = True
        try:
            for n in range(RECV_BURST):
                # Past the first message, EVENTS says whether another is queued (it
                # costs a third of the Again that recv would raise; see below).
                if n and not _events(rx) & _POLLIN:
                    return
                try:
                    first = rx.recv(_NOBLOCK, copy=False)
                except zmq.Again:
                    # Reading EVENTS re-arms ZeroMQ's (edge-triggered) fd: stop only
                    # when nothing is queued, else a message would wait for the next one.
                    if _events(rx) & _POLLIN:
                        continue
                    return
                frames, dropped = self._receive_rest(rx, first)
                try:
                    dispatch.on_message(frames, dropped)
                except Exception as err:
                    # A bug (an accounting assert, say) costs this request, not the daemon.
                    self.supervisor.failed("dispatch", err)
                    dispatch.reply_internal(frames)
            self._schedule_receive()  # a long burst: let the handlers run first
        except Exception as err:  # the socket itself failed: serve() raises it
            if not broken.done():
                broken.set_exception(err)
        finally:
            receiving.in_callback = False

    def _schedule_receive(self) -> None:
        if not self._again and self._loop is not None:
            self._again = True
            self._loop.call_soon(self._on_readable)

    def _receive_rest(self, rx: zmq.Socket[Any], first: zmq.Frame) -> tuple[list[zmq.Frame], int]:
        """The other parts of the message ``first`` began (ZeroMQ delivers all of
        them at once), keeping at most the frame cap; returns (frames, dropped)."""
        frames = [first]
        keep = self.dispatch.max_frames + 2  # + routing id and a REQ delimiter
        dropped = 0
        part = first
        while part.more:
            part = rx.recv(_NOBLOCK, copy=False)
            if len(frames) < keep:
                frames.append(part)
            else:
                dropped += 1
        return frames, dropped

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests, let in-flight ones finish; True if all did in time."""
        tasks = self.dispatch.tasks
        self.dispatch.refuse_new()
        refuser = asyncio.get_running_loop().create_task(self.serve())
        deadline = time.monotonic() + timeout_s
        try:
            while (tasks or self.sent) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            refuser.cancel()
        clean = not tasks and not self.sent
        # Cancelled handlers reply SHUTTING_DOWN; let them run before the socket closes.
        stragglers = list(tasks)
        for task in stragglers:
            task.cancel()
        await asyncio.gather(*stragglers, return_exceptions=True)
        return clean

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        receiving = self.receiving
        if receiving.broken is not None and self._loop is not None and receiving.rx is not None:
            self._loop.remove_reader(cast(int, receiving.rx.getsockopt(zmq.FD)))
            receiving.broken = None
        receiving.rx = None  # a shadow: closing self.sock closes it
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        self.sent.close()
