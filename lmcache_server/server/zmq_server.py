"""The ZeroMQ front end: one ROUTER socket, one event loop, exactly one reply per request.

Flow per message: receive at most ``max_keys_per_request + 1`` frames (the
rest are drained and dropped: TOO_LARGE) -> split the envelope -> decode and
validate the header (errors become error replies) -> access check (with
``auth: curve``: the connection's client name against the op and namespace;
FORBIDDEN) -> admission (the client's own request and byte limits, then the
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
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, cast

import zmq
import zmq.asyncio

from lmcache_client.protocol import ErrorCode, Limits, Op, ProtocolError, decode_request, encode_error, encode_reply

from ..config import ConfigError, ServerConfig
from ..metrics import ServerMetrics
from ..security import Security
from ..security.access import namespace_view
from ..supervisor import Supervisor
from .admission import ByteBudget, ClientLedger
from .handlers import Handlers, Outcome
from .outgoing import Owners, SentReplies
from .outgoing import release as _release
from .tokens import take_tokens

logger = logging.getLogger(__name__)

ZERO_COPY_THRESHOLD = 64 * 1024
"""Payloads smaller than this are copied into the reply (cheaper than tracking them)."""
MAX_CONCURRENT_REQUESTS = 4096
RECV_BURST = 64
"""Requests dispatched back to back before the receive loop lets their handlers run."""
_NOBLOCK = int(zmq.NOBLOCK)  # plain ints: pyzmq's enum operators cost more than the calls
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
_SNDMORE = int(zmq.SNDMORE)
_send_frame = zmq.backend.Socket.send
"""pyzmq's own send under its Python wrappers: ``send_multipart`` checks every part's
type and ORs enum flags per part (~5 us of ~7 for a reply of three small frames)."""
HARD_FRAME_LIMIT_FACTOR = 2
"""libzmq drops the connection of a peer sending one frame larger than this
many times max_message_size (it must not even allocate it); frames between
1x and 2x get a TOO_LARGE error reply."""


def split_envelope(frames: list[Any]) -> tuple[list[bytes], list[Any]]:
    """ROUTER frames -> (envelope to echo, request frames).

    The envelope is the peer identity, plus the empty delimiter a REQ socket
    adds.  A REQ message always has a frame after its delimiter, so an empty
    frame 1 followed by more frames is a delimiter; a lone empty frame is a
    DEALER's (empty, malformed) header.
    """
    if len(frames) >= 3 and len(frames[1]) == 0:
        return [frames[0].bytes, b""], frames[2:]
    return [frames[0].bytes], frames[1:]


class ZmqServer:
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
        self.supervisor = supervisor if supervisor is not None else Supervisor()
        self.security = security if security is not None else Security(config, None, None)
        self.clients = ClientLedger(config.max_client_inflight_requests, config.max_client_inflight_bytes)
        # Limits over all connections of one client key (auth: curve), when set.
        key_limited = config.max_key_inflight_requests or config.max_key_inflight_bytes
        self.keys = (
            ClientLedger(config.max_key_inflight_requests or 1 << 62, config.max_key_inflight_bytes or 1 << 62)
            if key_limited and self.security.enabled
            else None
        )
        # A valid request has at most one payload frame per key and a tokens
        # frame; the envelope (routing id, REQ delimiter) comes on top.  Frames
        # beyond are dropped as they arrive, so a message of millions of empty
        # frames costs no Python objects.
        self.max_frames = config.max_keys_per_request + 2
        self._rx: zmq.Socket[Any] | None = None
        self.handlers = handlers
        self.budget = budget
        self.metrics = metrics
        self.context = context
        self.limits = Limits(
            # Keys and small fields only: token ids travel in a frame of their own
            # (server/tokens.py), so no header needs more, events on or off, and
            # a msgpack object bomb decodes at most this many bytes' objects.
            max_header_bytes=max(64 * 1024, config.max_keys_per_request * 40 + 4096),
            max_keys=config.max_keys_per_request,
            max_message_bytes=config.max_message_size,
        )
        self.sock: zmq.asyncio.Socket | None = None
        self.draining = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.replies = SentReplies(budget)
        """Zero-copy replies still being sent (their chunks stay leased until then)."""
        self._sweeper: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._broken: asyncio.Future[None] | None = None
        """serve()'s future: the reader callback fails it when the socket breaks."""
        self._receiving = False  # in the reader callback (its sends need no wake-up check)
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
        self._rx = zmq.Socket.shadow(sock.underlying)

    async def serve(self) -> None:
        """Receive and dispatch requests until cancelled.

        The socket's fd reader does the receiving, in the event loop's own
        callback (no coroutine hop per wake-up); this coroutine installs it and
        re-raises what broke it."""
        assert self.sock is not None, "bind() first"
        if self._sweeper is None:
            self._sweeper = self.supervisor.spawn("reply_sweeper", self.replies.run)
        assert self._rx is not None
        loop = asyncio.get_running_loop()
        broken: asyncio.Future[None] = loop.create_future()
        self._loop = loop
        self._broken = broken
        fd = cast(int, self._rx.getsockopt(zmq.FD))
        loop.add_reader(fd, self._on_readable)
        try:
            self._on_readable()  # what queued before the reader was installed
            await broken
        finally:
            # A serve() started after this one was cancelled (drain's) owns the reader now.
            if self._broken is broken:
                self._broken = None
                if self._rx is not None:
                    loop.remove_reader(fd)

    def _on_readable(self) -> None:
        """Receive and dispatch what is queued, at most RECV_BURST requests per call
        (then again after the handlers made ready meanwhile)."""
        self._again = False
        rx = self._rx
        broken = self._broken
        if rx is None or broken is None or broken.done():
            return
        self._receiving = True
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
                frames, dropped = self._receive_rest(first)
                try:
                    self._dispatch(frames, dropped)
                except Exception as err:
                    # A bug (an accounting assert, say) costs this request, not the daemon.
                    self.supervisor.failed("dispatch", err)
                    self._reply_internal(frames)
            self._schedule_receive()  # a long burst: let the handlers run first
        except Exception as err:  # the socket itself failed: serve() raises it
            if not broken.done():
                broken.set_exception(err)
        finally:
            self._receiving = False

    def _schedule_receive(self) -> None:
        if not self._again and self._loop is not None:
            self._again = True
            self._loop.call_soon(self._on_readable)

    def _receive_rest(self, first: zmq.Frame) -> tuple[list[zmq.Frame], int]:
        """The other parts of the message ``first`` began (ZeroMQ delivers all of
        them at once), keeping at most the frame cap; returns (frames, dropped)."""
        assert self._rx is not None
        frames = [first]
        keep = self.max_frames + 2  # + routing id and a REQ delimiter
        dropped = 0
        part = first
        while part.more:
            part = self._rx.recv(_NOBLOCK, copy=False)
            if len(frames) < keep:
                frames.append(part)
            else:
                dropped += 1
        return frames, dropped

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests, let in-flight ones finish; True if all did in time."""
        self.draining = True
        refuser = asyncio.get_running_loop().create_task(self.serve())
        deadline = time.monotonic() + timeout_s
        try:
            while (self._tasks or self.replies) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            refuser.cancel()
        clean = not self._tasks and not self.replies
        # Cancelled handlers reply SHUTTING_DOWN; let them run before the socket closes.
        stragglers = list(self._tasks)
        for task in stragglers:
            task.cancel()
        await asyncio.gather(*stragglers, return_exceptions=True)
        return clean

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._broken is not None and self._loop is not None and self._rx is not None:
            self._loop.remove_reader(cast(int, self._rx.getsockopt(zmq.FD)))
            self._broken = None
        self._rx = None  # a shadow: closing self.sock closes it
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        self.replies.close()

    # -- requests ------------------------------------------------------------------
    def _dispatch(self, frames: list[Any], dropped_frames: int = 0) -> None:
        started = time.perf_counter()
        if self.replies:
            # Release finished sends first, so a request never sees a chunk
            # still leased by a reply its client has already received.
            self.replies.sweep()
        envelope, body = split_envelope(frames)
        if dropped_frames:
            self._refuse_frames(envelope, body, dropped_frames, started)
            return
        try:
            request = decode_request(body, self.limits)
        except ProtocolError as err:
            logger.debug("refused a request: %s", err)
            if err.limit is not None:
                self.metrics.limit_violations.labels(err.limit).inc()
            self._reply_error(envelope, err.request_id, err.code, err.message, "invalid", started)
            return
        op = request.op.value
        scoped = False  # a stats reply cut down to the client's namespace
        user_id: str | None = None
        if self.security.enabled:
            # Before anything touches the store: a refused probe costs the same
            # and says the same whether or not the chunks exist.
            user_id = _user_id(frames[-1])
            denied = self.security.check(user_id, request)
            if denied is not None:
                self.metrics.forbidden.labels(user_id or "").inc()
                self._reply_error(envelope, request.id, ErrorCode.FORBIDDEN, denied, op, started)
                return
            scoped = request.op is Op.STATS and not self.security.sees_everything(user_id)
        if "tokens" in request.fields:
            try:
                take_tokens(request, self.config.chunk_size)
            except ProtocolError as err:
                self._reply_error(envelope, request.id, err.code, err.message, op, started)
                return
        if self.draining:
            self._reply_error(envelope, request.id, ErrorCode.SHUTTING_DOWN, "server is shutting down", op, started)
            return
        size = request.payload_bytes
        owners: Owners = ((self.clients, envelope[0]),)
        over = self.clients.try_admit(envelope[0], size)
        if over is None and self.keys is not None and user_id:
            key_owner = user_id.encode()
            key_over = self.keys.try_admit(key_owner, size)
            if key_over is None:
                owners += ((self.keys, key_owner),)
            else:
                self.clients.release(envelope[0], size)
                over = "key_" + key_over.removeprefix("client_")  # key_requests, key_bytes
        if over is not None:
            self.metrics.busy.inc()
            self.metrics.limit_violations.labels(over).inc()
            whose = "this client key's" if over.startswith("key_") else "this connection's"
            message = f"{whose} in-flight limit is spent ({over}); retry"
            self._reply_error(envelope, request.id, ErrorCode.BUSY, message, op, started)
            return
        held = self.clients.in_flight(envelope[0])[1] - size  # the connection's bytes before this request
        if size and held and size > self.budget.share(held):
            _release(owners, size)
            self.metrics.busy.inc()
            self.metrics.limit_violations.labels("fair_share").inc()
            message = "this connection holds its share of the in-flight budget; retry"
            self._reply_error(envelope, request.id, ErrorCode.BUSY, message, op, started)
            return
        if len(self._tasks) >= MAX_CONCURRENT_REQUESTS or not self.budget.try_acquire(size):
            _release(owners, size)
            self.metrics.busy.inc()
            self._reply_error(envelope, request.id, ErrorCode.BUSY, "in-flight budget spent; retry", op, started)
            return
        if request.op is Op.LOOKUP and self._answer_now(envelope, request, started, owners):
            return
        self.metrics.received_bytes.inc(size)
        task = asyncio.get_running_loop().create_task(self._run(envelope, request, size, started, scoped, owners))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _answer_now(self, envelope: list[bytes], request: Any, started: float, owners: Owners) -> bool:
        """Answer an admitted request in the receive loop when its handler needs no
        waiting (a lookup of local tiers: a task would cost more than the lookup);
        False: it was not answered, run it as a task."""
        try:
            outcome = self.handlers.lookup_now(request)
        except BaseException:
            _release(owners, 0)
            raise
        if outcome is None:
            return False
        _release(owners, 0)  # done: nothing of it stays in flight
        self._reply(envelope, request.id, outcome, request.op.value, started, ())
        return True

    def _reply_internal(self, frames: list[Any]) -> None:
        """INTERNAL for a message whose dispatch failed (its id, when it can be read)."""
        try:
            envelope, body = split_envelope(frames)
            request_id: int | None = None
            try:
                request_id = decode_request(body, self.limits).id
            except ProtocolError as err:
                request_id = err.request_id
            started = time.perf_counter()
            self._reply_error(envelope, request_id, ErrorCode.INTERNAL, "internal error", "invalid", started)
        except Exception:
            logger.exception("could not even answer INTERNAL to a failed request")

    def _refuse_frames(self, envelope: list[bytes], body: list[Any], dropped: int, started: float) -> None:
        """A message over the frame cap.  The header is checked alone first, so a
        header that is itself refused (e.g. TOO_MANY_KEYS) gets its own code."""
        try:
            request_id: int | None = decode_request(body[:1], self.limits).id
        except ProtocolError as err:
            if err.code != ErrorCode.PAYLOAD_MISMATCH:
                if err.limit is not None:
                    self.metrics.limit_violations.labels(err.limit).inc()
                self._reply_error(envelope, err.request_id, err.code, err.message, "invalid", started)
                return
            request_id = err.request_id
        self.metrics.limit_violations.labels("frames").inc()
        message = f"message has {len(body) + dropped} frames, limit {self.max_frames} (header + one per key + tokens)"
        self._reply_error(envelope, request_id, ErrorCode.TOO_LARGE, message, "invalid", started)

    async def _run(
        self, envelope: list[bytes], request: Any, size: int, started: float, scoped: bool, owners: Owners
    ) -> None:
        op = request.op.value
        budgeted = counted = True  # the request's bytes in the server's budget / its connection's share

        def release_budget() -> None:
            nonlocal budgeted
            if budgeted:
                budgeted = False
                self.budget.release(size)

        def release_share() -> None:
            nonlocal counted
            if counted:
                counted = False
                _release(owners, size)

        peer = envelope[0]

        def reply_share() -> int:
            return self.budget.share(self.clients.in_flight(peer)[1])

        try:
            outcome = await self.handlers.handle(request, reply_share)
            if outcome.trimmed:
                self.metrics.limit_violations.labels("fair_share").inc()
            if scoped:
                outcome.fields["stats"] = namespace_view(outcome.fields["stats"])
            release_share()  # the connection's share ends with the answer
            pending = self._reply(envelope, request.id, outcome, op, started, owners)
            # A put's payload frames are copied into the pool after the reply:
            # they stay in the server's budget until that is done.
            if pending is not None and not pending.done():
                pending.add_done_callback(lambda _: release_budget())
            else:
                release_budget()
            return
        except ProtocolError as err:
            if err.code == ErrorCode.BUSY:
                self.metrics.busy.inc()
            self._reply_error(envelope, request.id, err.code, err.message, op, started)
        except asyncio.CancelledError:
            self._reply_error(envelope, request.id, ErrorCode.SHUTTING_DOWN, "server is shutting down", op, started)
            release_budget()
            release_share()
            raise
        except Exception as err:
            self.supervisor.failed(f"request {op}", err)
            self._reply_error(envelope, request.id, ErrorCode.INTERNAL, "internal error", op, started)
        release_budget()
        release_share()

    def _reply(
        self, envelope: list[bytes], request_id: int, outcome: Outcome, op: str, started: float, owners: Owners
    ) -> asyncio.Future[None] | None:
        """Send a success reply; returns what ``outcome.after_reply`` returned."""
        try:
            frames: list[Any] = encode_reply(request_id, **outcome.fields)
        except BaseException:
            for chunk in outcome.chunks:
                chunk.release()
            self.budget.release(outcome.budget_bytes)
            raise
        tracked: list[zmq.Frame] = []
        for chunk in outcome.chunks:
            if chunk.nbytes >= ZERO_COPY_THRESHOLD:
                frame = zmq.Frame(chunk.data, copy=False, track=True)
                tracked.append(frame)
                frames.append(frame)
            else:
                frames.append(bytes(chunk.data))
        self.metrics.sent_bytes.inc(outcome.budget_bytes + outcome.shm_out_bytes)
        if outcome.shm_in_bytes:
            self.metrics.received_bytes.inc(outcome.shm_in_bytes)
        out = self.replies.start(zmq.MessageTracker(*tracked), outcome.chunks, outcome.budget_bytes, owners)
        pending: asyncio.Future[None] | None = None
        try:
            self._send(envelope + frames)
        finally:
            self.replies.sent(out, bool(tracked))
            if outcome.after_reply is not None:
                pending = outcome.after_reply()
        self.metrics.observe(op, "ok", time.perf_counter() - started)
        return pending

    def _reply_error(
        self, envelope: list[bytes], request_id: int | None, code: ErrorCode, message: str, op: str, started: float
    ) -> None:
        self._send(envelope + encode_error(request_id, code, message))
        self.metrics.observe(op, code.name, time.perf_counter() - started)

    def _send(self, frames: list[Any]) -> None:
        rx = self._rx
        if rx is None:
            return
        # ROUTER sends never block: a peer over its high-water mark loses the
        # reply (clients keep fewer than zmq_hwm requests outstanding).  A plain
        # non-blocking send (zmq.asyncio's future machinery cost more than the
        # send); ZeroMQ's fd is edge-triggered and a send may consume the signal
        # of a request that arrived meanwhile, so the receive loop is woken when
        # one is queued.
        try:
            last = len(frames) - 1
            for i, frame in enumerate(frames):
                # ROUTER decides at the first part (the routing id) whether the message goes out.
                _send_frame(rx, frame, _NOBLOCK | _SNDMORE if i < last else _NOBLOCK, copy=False)
        except zmq.ZMQError as err:
            logger.warning("could not send a reply: %s", err)
        if not self._receiving and self._broken is not None and _events(rx) & _POLLIN:
            self._schedule_receive()


def _events(sock: zmq.Socket[Any]) -> int:
    """ZMQ_EVENTS of ``sock`` (reading it also processes ZeroMQ's pending commands)."""
    return cast(int, sock.getsockopt(_EVENTS))


def _user_id(frame: zmq.Frame) -> str | None:
    """The client name the ZAP handler gave this frame's connection (None without one)."""
    try:
        value = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError, TypeError):
        return None
    return value if isinstance(value, str) and value else None
