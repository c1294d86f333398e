"""Why a connection to the daemon never completed: its ZMTP handshake events.

A DEALER socket whose handshake fails retries quietly, so a request only
times out.  :class:`HandshakeWatch` listens to the socket's handshake events
(a libzmq socket monitor, handshake events only) and turns the last failure
since the last success into a sentence for the error the client raises: a
client key the daemon does not know (ZAP status 400), a wrong
``server_public_key``, or CURVE configured on one side only.

Primitive: :class:`HandshakeWatch` (``reason``, ``close``).
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_MECHANISM_MISMATCH = 0x11000002  # ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
_ids = itertools.count()


def explain(event: int, value: int, curve: bool) -> str:
    """A sentence for a failed handshake event of a client socket."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        if value == 400:
            return (
                "the daemon refused this client's CURVE key (ZAP status 400): "
                "its public key must be in the daemon's client keys"
            )
        return f"the daemon's authentication failed (ZAP status {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _MECHANISM_MISMATCH:
        if curve:
            return "the daemon does not use CURVE, but this client has CURVE keys"
        return "the daemon requires CURVE: this client needs server_public_key and client_secret_key"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return f"the handshake broke the ZMTP protocol (error 0x{value:x})"
    if curve:
        return "the CURVE handshake failed: is server_public_key the daemon's public key?"
    return "the handshake failed"


class HandshakeWatch:
    """Handshake events of one socket; attach it before the socket connects."""

    def __init__(self, sock: zmq.Socket[Any], curve: bool):
        self.curve = curve
        self._sock = sock
        self._failure: tuple[int, int] | None = None
        address = f"inproc://lmcache-handshake-{os.getpid()}-{id(sock)}-{next(_ids)}"
        sock.monitor(address, _EVENTS)
        # A plain socket on the same libzmq context, so the asyncio client can read it without awaiting.
        self._events: zmq.Socket[bytes] = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
        self._events.setsockopt(zmq.LINGER, 0)
        self._events.connect(address)

    def reason(self) -> str | None:
        """Why the handshakes since the last successful one failed (the last specific
        reason, else the last one); None if none did."""
        while self._events.poll(0):
            message = parse_monitor_message(self._events.recv_multipart())
            event = int(message["event"])
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._failure = None
            elif event != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL or self._failure is None:
                self._failure = (event, int(message["value"]))
            # A retry that breaks off without detail (the peer closed the connection
            # mid-handshake) keeps the specific reason an earlier attempt gave: on a
            # loaded host a refused client often sees one of each, in either order.
        return explain(*self._failure, self.curve) if self._failure else None

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass  # the socket is closed already
        self._events.close(linger=0)
