"""The sync client's connection to its daemon: one DEALER socket and the round trip.

A request is sent without blocking (zero-copy from :data:`COPY_THRESHOLD` up)
and its reply awaited until ``timeout_s``; after a timeout the socket is
replaced, so nothing stale is ever read.  Every call goes through the fail-open
breaker (:mod:`lmcache_client.failopen`).  :func:`new_dealer`,
:func:`unavailable` and :func:`namespace_string` serve the asyncio client too.

Primitives: :class:`Connection` (the transport part of
:class:`~lmcache_client.client.CacheClient`: ``run``, ``tell``, ``close``,
``breaker_says_miss``, its ``breaker``), :func:`new_dealer`, :func:`unavailable`, :func:`namespace_string`,
:data:`DEFAULT_ADDRESS`, :data:`ADDRESS_ENV`, :data:`COPY_THRESHOLD`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, TypeVar

import zmq

from .calls import Call
from .curve import CurveKeys
from .errors import BadAddress, DaemonUnavailable
from .failopen import MISS, PROBE
from .handshake import HandshakeWatch
from .namespace import Namespace
from .options import ClientOptions, request_ids
from .protocol import Op, decode_reply, encode_request

logger = logging.getLogger("lmcache_client.client")  # the logger these lines always had
T = TypeVar("T")

DEFAULT_ADDRESS = "tcp://127.0.0.1:65432"
ADDRESS_ENV = "LMCACHE_SERVER_ADDRESS"
"""The environment variable that names the daemon where no flag or setting does: read by
the vLLM connector and by ``lmcache-server admin`` alike (one variable for a host's tools)."""
COPY_THRESHOLD = 64 * 1024
"""Payloads at least this large are sent zero-copy (pyzmq copies smaller ones anyway)."""


def namespace_string(namespace: Namespace | str | None) -> str | None:
    return namespace.wire() if isinstance(namespace, Namespace) else namespace


def new_dealer(
    ctx: zmq.Context[Any], address: str, hwm: int, curve: CurveKeys | None = None, watch: bool = False
) -> Any:
    """A DEALER socket connected to ``address`` (sync or asyncio, after ``ctx``'s kind),
    a CURVE client of the daemon when ``curve`` is given.  ``watch``: return
    ``(socket, HandshakeWatch)``, the watch attached before the socket connects."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(sock)
    # IMMEDIATE: queue only on completed connections, so a dead daemon is
    # noticed at send time instead of messages piling up for later delivery.
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    handshakes = HandshakeWatch(sock, curve is not None) if watch else None
    try:
        sock.connect(address)
    except zmq.ZMQError as err:  # a socket left open here would hold the context at exit
        if handshakes is not None:
            handshakes.close()
        sock.close(linger=0)
        raise BadAddress(
            f"cannot connect to the daemon at {address!r}: {err.strerror} "
            "(an endpoint is tcp://HOST:PORT or ipc:///PATH)"
        ) from err
    return (sock, handshakes) if watch else sock


def unavailable(what: str, handshakes: HandshakeWatch | None) -> DaemonUnavailable:
    """DaemonUnavailable saying ``what``, and why the handshake failed when it did."""
    reason = handshakes.reason() if handshakes is not None else None
    return DaemonUnavailable(f"{what}: {reason}" if reason else what)


class Connection:
    """The sync client's socket, its request ids and its fail-open breaker."""

    def __init__(self, options: ClientOptions, context: zmq.Context[Any] | None = None):
        self.address = options.address
        self.timeout_s = options.timeout_s
        """A request's timeout unless the call names another (settable)."""
        self.breaker = options.breaker()
        """The fail-open breaker, which also counts failures, BUSY replies and short circuits."""
        self._curve = options.curve
        self._hwm = options.hwm
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket[Any] | None = None
        self._handshakes: HandshakeWatch | None = None
        self._ids = request_ids()
        self._reset()

    @property
    def is_open(self) -> bool:
        """Whether the socket is still there (not closed)."""
        return self._sock is not None

    def close(self) -> None:
        if self._handshakes is not None:
            self._handshakes.close()
            self._handshakes = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _reset(self) -> None:
        self.close()
        self._sock, self._handshakes = new_dealer(self._ctx, self.address, self._hwm, self._curve, watch=True)

    def _roundtrip(self, frames: list[Any], request_id: int, timeout_s: float) -> tuple[Any, list[Any]]:
        if self._sock is None:
            raise RuntimeError("client is closed")
        sock = self._sock
        deadline = time.monotonic() + timeout_s
        big = any(memoryview(f).nbytes >= COPY_THRESHOLD for f in frames[1:])
        while True:
            try:
                tracker = sock.send_multipart(frames, zmq.NOBLOCK, copy=not big, track=big)
                break
            except zmq.Again:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sock.poll(int(remaining * 1000) + 1, zmq.POLLOUT):
                    raise unavailable(f"no connection to {self.address}", self._handshakes) from None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sock.poll(int(remaining * 1000) + 1, zmq.POLLIN):
                self._abandon(tracker, timeout_s)
                raise unavailable(f"no reply from {self.address} within {timeout_s}s", self._handshakes)
            reply_frames = sock.recv_multipart(copy=False)
            try:
                reply = decode_reply(reply_frames[0].buffer)
            except ValueError:
                logger.warning("dropping a reply that is not protocol v1")
                continue
            # The socket is replaced after every timeout, so nothing stale arrives
            # here; an error reply without id (header unreadable) is ours too.
            if reply.id == request_id or (reply.id is None and not reply.ok):
                return reply, [f.buffer for f in reply_frames[1:]]

    def _abandon(self, tracker: zmq.MessageTracker | None, timeout_s: float) -> None:
        """After a timeout: make sure zmq no longer reads the caller's buffers."""
        if tracker is not None and not tracker.done:
            try:
                tracker.wait(timeout_s)
            except zmq.NotDone:
                logger.warning("a zero-copy send to %s is still pending; resetting the socket", self.address)
        self._reset()

    def run(self, call: Call[T], timeout_s: float | None = None) -> T:
        """Send ``call`` and return its parsed answer (fail-open: its miss when the daemon is out)."""
        if self.breaker_says_miss(call):
            return self.breaker.short_circuit(call)
        request_id = next(self._ids) & (2**64 - 1)
        frames = encode_request(call.op, request_id, call.namespace, call.keys, call.payloads, **call.fields)
        try:
            reply, payloads = self._roundtrip(frames, request_id, timeout_s or self.timeout_s)
        except DaemonUnavailable as err:
            return self.breaker.failed(call, err)
        return self.breaker.answered(call, reply, payloads)

    def breaker_says_miss(self, call: Call[Any]) -> bool:
        """Whether the open breaker answers ``call`` as a miss (probing first when due)."""
        gate = self.breaker.gate(call)
        if gate == MISS:
            return True
        if gate == PROBE:
            request_id = next(self._ids) & (2**64 - 1)
            try:
                reply, _ = self._roundtrip(
                    encode_request(Op.PING, request_id), request_id, self.breaker.probe_timeout_s
                )
            except DaemonUnavailable:
                reply = None
            if not self.breaker.probe_answered(reply):
                return True
        return False

    def tell(self, call: Call[Any]) -> None:
        """Send without waiting for the reply (the next round trip drops it)."""
        if self._sock is None:
            return
        request_id = next(self._ids) & (2**64 - 1)
        frames = encode_request(call.op, request_id, call.namespace, call.keys, call.payloads, **call.fields)
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            pass  # the lease expires by itself
