"""Sending replies, a part of :class:`.zmq_server.ZmqServer`: one reply per request.

A success reply is its header frames plus the outcome's chunks: a chunk of at
least ``ZERO_COPY_THRESHOLD`` bytes goes out straight from the memory pool
(a tracked zero-copy frame; the chunk stays leased until ZeroMQ is done with it,
see outgoing.py), a smaller one is copied.  Every send is a plain non-blocking
ROUTER send; after it the receive loop is woken when a request is queued
(ZeroMQ's fd is edge-triggered and a send may consume its signal).

Primitives: :class:`Replies` (``reply``, ``reply_error``, ``send``), the
server's sending part; :class:`Receiving`, the receive loop's state that
sending reads (the server's receive loop writes it); and :func:`_events`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, cast

import zmq

from lmcache_client.protocol import ErrorCode, encode_error, encode_reply

from ..metrics import ServerMetrics
from .handlers import Outcome
from .inflight import ByteBudget
from .outgoing import Owners, SentReplies

logger = logging.getLogger("lmcache_server.server.zmq_server")  # the server's log lines keep their logger name

ZERO_COPY_THRESHOLD = 64 * 1024
"""Payloads smaller than this are copied into the reply (cheaper than tracking them)."""
_NOBLOCK = int(zmq.NOBLOCK)  # plain ints: pyzmq's enum operators cost more than the calls
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
_SNDMORE = int(zmq.SNDMORE)
_send_frame = zmq.backend.Socket.send
"""pyzmq's own send under its Python wrappers: ``send_multipart`` checks every part's
type and ORs enum flags per part (~5 us of ~7 for a reply of three small frames)."""


@dataclasses.dataclass(slots=True, eq=False)
class Receiving:
    """What the server's receive loop holds now (zmq_server.py sets it; sending reads it)."""

    rx: zmq.Socket[Any] | None = None
    """The socket both loops use (a shadow of the server's): None before bind and after close."""
    broken: asyncio.Future[None] | None = None
    """serve()'s future while it serves: the reader callback fails it when the socket breaks."""
    in_callback: bool = False
    """In the reader callback (its sends need no wake-up check: it reads on anyway)."""


class Replies:
    """The sending part of the server: ``wake()`` runs the receive loop again soon
    (a send may consume the signal of a request queued meanwhile)."""

    def __init__(
        self,
        receiving: Receiving,
        budget: ByteBudget,
        metrics: ServerMetrics,
        sent: SentReplies,
        wake: Callable[[], None],
    ):
        self._receiving = receiving
        self._budget = budget
        self._metrics = metrics
        self._sent = sent
        self._wake = wake

    def reply(
        self, envelope: list[bytes], request_id: int, outcome: Outcome, op: str, started: float, owners: Owners
    ) -> asyncio.Future[None] | None:
        """Send a success reply; returns what ``outcome.after_reply`` returned."""
        try:
            frames: list[Any] = encode_reply(request_id, **outcome.fields)
        except BaseException:
            for chunk in outcome.chunks:
                chunk.release()
            self._budget.release(outcome.budget_bytes)
            raise
        tracked: list[zmq.Frame] = []
        for chunk in outcome.chunks:
            if chunk.nbytes >= ZERO_COPY_THRESHOLD:
                frame = zmq.Frame(chunk.data, copy=False, track=True)
                tracked.append(frame)
                frames.append(frame)
            else:
                frames.append(bytes(chunk.data))
        self._metrics.sent_bytes.inc(outcome.budget_bytes + outcome.shm_out_bytes)
        if outcome.shm_in_bytes:
            self._metrics.received_bytes.inc(outcome.shm_in_bytes)
        out = self._sent.start(zmq.MessageTracker(*tracked), outcome.chunks, outcome.budget_bytes, owners)
        pending: asyncio.Future[None] | None = None
        try:
            self.send(envelope + frames)
        finally:
            self._sent.sent(out, bool(tracked))
            if outcome.after_reply is not None:
                pending = outcome.after_reply()
        self._metrics.observe(op, "ok", time.perf_counter() - started)
        return pending

    def reply_error(
        self, envelope: list[bytes], request_id: int | None, code: ErrorCode, message: str, op: str, started: float
    ) -> None:
        self.send(envelope + encode_error(request_id, code, message))
        self._metrics.observe(op, code.name, time.perf_counter() - started)

    def send(self, frames: list[Any]) -> None:
        receiving = self._receiving
        rx = receiving.rx
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
        if not receiving.in_callback and receiving.broken is not None and _events(rx) & _POLLIN:
            self._wake()


def _events(sock: zmq.Socket[Any]) -> int:
    """ZMQ_EVENTS of ``sock`` (reading it also processes ZeroMQ's pending commands)."""
    return cast(int, sock.getsockopt(_EVENTS))
