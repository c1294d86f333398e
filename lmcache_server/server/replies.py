"""Sending replies, for :class:`.zmq_server.ZmqServer`: one reply per request.

A success reply is its header frames plus the outcome's chunks: a chunk of at
least ``ZERO_COPY_THRESHOLD`` bytes goes out straight from the memory pool
(a tracked zero-copy frame; the chunk stays leased until ZeroMQ is done with it,
see outgoing.py), a smaller one is copied.  Every send is a plain non-blocking
ROUTER send; after it the receive loop is woken when a request is queued
(ZeroMQ's fd is edge-triggered and a send may consume its signal).

Primitives: :class:`ReplySender` (``_reply``, ``_reply_error``, ``_send``), the
base of the server class, and :func:`_events`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, cast

import zmq

from lmcache_client.protocol import ErrorCode, encode_error, encode_reply

from ..metrics import ServerMetrics
from .admission import ByteBudget
from .handlers import Outcome
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


class ReplySender:
    """The sending side of the server; the attributes are set by ``ZmqServer.__init__``."""

    _rx: zmq.Socket[Any] | None
    _broken: asyncio.Future[None] | None
    _receiving: bool
    budget: ByteBudget
    metrics: ServerMetrics
    replies: SentReplies

    def _schedule_receive(self) -> None:
        """Run the receive loop again soon (the server's receive loop defines it)."""
        raise NotImplementedError

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
