"""From a received message to its handler, a part of :class:`.zmq_server.ZmqServer`.

Per message: split the envelope -> decode and validate the header (errors
become error replies) -> access check (with ``auth: curve``: the connection's
client name against the op and namespace; FORBIDDEN) -> token ids -> in-flight limits
(the client's own request and byte limits, then the server's byte budget and
task cap; BUSY when spent) -> a handler task -> one reply.  A lookup that local
tiers answer is answered at once, without a task.  A message over the frame
cap gets TOO_LARGE, a dispatch that fails INTERNAL.

Primitives: :class:`Dispatch` (``on_message``, ``reply_internal``,
``refuse_new``, ``tasks``), the server's part between its receive loop and its
replies (:class:`.replies.Replies`), and :func:`split_envelope`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import zmq

from lmcache_client.protocol import ErrorCode, Limits, Op, ProtocolError, decode_request, header_limit

from ..config import ServerConfig
from ..metrics import ServerMetrics
from ..security import Security
from ..security.access import namespace_view
from ..supervisor import Supervisor
from .handlers import Handlers
from .inflight import ByteBudget, ClientLedger
from .outgoing import Owners, SentReplies
from .outgoing import release as _release
from .replies import Replies
from .tokens import take_tokens

logger = logging.getLogger("lmcache_server.server.zmq_server")  # the server's log lines keep their logger name

MAX_CONCURRENT_REQUESTS = 4096


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


class Dispatch:
    """The request part of the server: access, in-flight limits, a handler task, its reply."""

    def __init__(
        self,
        config: ServerConfig,
        handlers: Handlers,
        budget: ByteBudget,
        metrics: ServerMetrics,
        security: Security,
        supervisor: Supervisor,
        replies: Replies,
        sent: SentReplies,
    ):
        self.config = config
        self.handlers = handlers
        self.budget = budget
        self.metrics = metrics
        self.security = security
        self.supervisor = supervisor
        self.replies = replies
        self.sent = sent
        """Zero-copy replies still being sent: swept before each request."""
        self.clients = ClientLedger(config.max_client_inflight_requests, config.max_client_inflight_bytes)
        # Limits over all connections of one client key (auth: curve), when set.
        key_limited = config.max_key_inflight_requests or config.max_key_inflight_bytes
        self.keys = (
            ClientLedger(config.max_key_inflight_requests or 1 << 62, config.max_key_inflight_bytes or 1 << 62)
            if key_limited and security.enabled
            else None
        )
        # A valid request has at most one payload frame per key and a tokens
        # frame; the envelope (routing id, REQ delimiter) comes on top.  Frames
        # beyond are dropped as they arrive, so a message of millions of empty
        # frames costs no Python objects.
        self.max_frames = config.max_keys_per_request + 2
        self.limits = Limits(
            # Keys, one integer per key and small fields only: token ids travel in a
            # frame of their own (server/tokens.py), so no header needs more, events on
            # or off; and never more than MAX_HEADER_BYTES whatever the configuration:
            # a msgpack object bomb decodes at most this many bytes' objects.
            max_header_bytes=header_limit(config.max_keys_per_request),
            max_keys=config.max_keys_per_request,
            max_message_bytes=config.max_message_size,
        )
        self.draining = False
        self.tasks: set[asyncio.Task[None]] = set()
        """The handler tasks running now."""

    def refuse_new(self) -> None:
        """Answer SHUTTING_DOWN to every request from now on (the server drains)."""
        self.draining = True

    def on_message(self, frames: list[Any], dropped_frames: int = 0) -> None:
        started = time.perf_counter()
        if self.sent:
            # Release finished sends first, so a request never sees a chunk
            # still leased by a reply its client has already received.
            self.sent.sweep()
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
            self.replies.reply_error(envelope, err.request_id, err.code, err.message, "invalid", started)
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
                self.replies.reply_error(envelope, request.id, ErrorCode.FORBIDDEN, denied, op, started)
                return
            scoped = request.op is Op.STATS and not self.security.sees_everything(user_id)
        if "tokens" in request.fields:
            try:
                take_tokens(request, self.config.chunk_size)
            except ProtocolError as err:
                self.replies.reply_error(envelope, request.id, err.code, err.message, op, started)
                return
        if self.draining:
            self.replies.reply_error(
                envelope, request.id, ErrorCode.SHUTTING_DOWN, "server is shutting down", op, started
            )
            return
        size = request.payload_bytes
        owners: Owners = ((self.clients, envelope[0]),)
        over = self.clients.try_acquire(envelope[0], size)
        if over is None and self.keys is not None and user_id:
            key_owner = user_id.encode()
            key_over = self.keys.try_acquire(key_owner, size)
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
            self.replies.reply_error(envelope, request.id, ErrorCode.BUSY, message, op, started)
            return
        held = self.clients.in_flight(envelope[0])[1] - size  # the connection's bytes before this request
        if size and held and size > self.budget.share(held):
            _release(owners, size)
            self.metrics.busy.inc()
            self.metrics.limit_violations.labels("fair_share").inc()
            message = "this connection holds its share of the in-flight budget; retry"
            self.replies.reply_error(envelope, request.id, ErrorCode.BUSY, message, op, started)
            return
        if len(self.tasks) >= MAX_CONCURRENT_REQUESTS or not self.budget.try_acquire(size):
            _release(owners, size)
            self.metrics.busy.inc()
            self.replies.reply_error(envelope, request.id, ErrorCode.BUSY, "in-flight budget spent; retry", op, started)
            return
        if request.op is Op.LOOKUP and self._answer_now(envelope, request, started, owners):
            return
        self.metrics.received_bytes.inc(size)
        task = asyncio.get_running_loop().create_task(self._run(envelope, request, size, started, scoped, owners))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _answer_now(self, envelope: list[bytes], request: Any, started: float, owners: Owners) -> bool:
        """Answer a request within its limits in the receive loop when its handler needs no
        waiting (a lookup of local tiers: a task would cost more than the lookup);
        False: it was not answered, run it as a task."""
        try:
            outcome = self.handlers.lookup_now(request, envelope[0])
        except ProtocolError as err:  # a bad field (prefetch): its error reply, as from a task
            _release(owners, 0)
            self.replies.reply_error(envelope, request.id, err.code, err.message, request.op.value, started)
            return True
        except BaseException:
            _release(owners, 0)
            raise
        if outcome is None:
            return False
        _release(owners, 0)  # done: nothing of it stays in flight
        self.replies.reply(envelope, request.id, outcome, request.op.value, started, ())
        return True

    def reply_internal(self, frames: list[Any]) -> None:
        """INTERNAL for a message whose dispatch failed (its id, when it can be read)."""
        try:
            envelope, body = split_envelope(frames)
            request_id: int | None = None
            try:
                request_id = decode_request(body, self.limits).id
            except ProtocolError as err:
                request_id = err.request_id
            started = time.perf_counter()
            self.replies.reply_error(envelope, request_id, ErrorCode.INTERNAL, "internal error", "invalid", started)
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
                self.replies.reply_error(envelope, err.request_id, err.code, err.message, "invalid", started)
                return
            request_id = err.request_id
        self.metrics.limit_violations.labels("frames").inc()
        message = f"message has {len(body) + dropped} frames, limit {self.max_frames} (header + one per key + tokens)"
        self.replies.reply_error(envelope, request_id, ErrorCode.TOO_LARGE, message, "invalid", started)

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
            outcome = await self.handlers.handle(request, reply_share, peer)
            if outcome.trimmed:
                self.metrics.limit_violations.labels("fair_share").inc()
            if scoped:
                outcome.fields["stats"] = namespace_view(outcome.fields["stats"])
            release_share()  # the connection's share ends with the answer
            pending = self.replies.reply(envelope, request.id, outcome, op, started, owners)
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
            self.replies.reply_error(envelope, request.id, err.code, err.message, op, started)
        except asyncio.CancelledError:
            self.replies.reply_error(
                envelope, request.id, ErrorCode.SHUTTING_DOWN, "server is shutting down", op, started
            )
            release_budget()
            release_share()
            raise
        except Exception as err:
            self.supervisor.failed(f"request {op}", err)
            self.replies.reply_error(envelope, request.id, ErrorCode.INTERNAL, "internal error", op, started)
        release_budget()
        release_share()


def _user_id(frame: zmq.Frame) -> str | None:
    """The client name the ZAP handler gave this frame's connection (None without one)."""
    try:
        value = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError, TypeError):
        return None
    return value if isinstance(value, str) and value else None
