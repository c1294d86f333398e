"""The client's handshake watch (lmcache_client/handshake.py): the reason it gives for a
connection that never completed keeps the specific failure over a retry that broke off
without detail (the cause of a test that failed at random on a loaded host: a CURVE
client of a plain daemon sees a mechanism mismatch and, on a retry, a bare failure)."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import pytest
import zmq

from lmcache_client.handshake import _MECHANISM_MISMATCH, HandshakeWatch


@pytest.fixture
def watch() -> Iterator[tuple[HandshakeWatch, zmq.Socket[bytes]]]:
    """A watch on a real DEALER socket whose event feed the test writes itself."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    w = HandshakeWatch(sock, curve=True)
    w._events.close(linger=0)
    feed = context.socket(zmq.PAIR)
    feed.bind("inproc://handshake-feed")
    w._events = context.socket(zmq.PAIR)
    w._events.connect("inproc://handshake-feed")
    try:
        yield w, feed
    finally:
        w.close()
        feed.close(linger=0)
        sock.close(linger=0)
        context.term()


def send(feed: zmq.Socket[bytes], event: int, value: int = 0) -> None:
    feed.send_multipart([struct.pack("=hi", event, value), b"tcp://127.0.0.1:1"])


def settle(w: HandshakeWatch) -> None:
    w._events.poll(1000)


def test_a_bare_retry_failure_keeps_the_specific_reason(watch: tuple[HandshakeWatch, zmq.Socket[bytes]]) -> None:
    w, feed = watch
    send(feed, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, _MECHANISM_MISMATCH)
    send(feed, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    settle(w)
    assert w.reason() == "the daemon does not use CURVE, but this client has CURVE keys"


def test_a_bare_failure_alone_is_still_reported_and_a_success_clears_it(
    watch: tuple[HandshakeWatch, zmq.Socket[bytes]],
) -> None:
    w, feed = watch
    assert w.reason() is None
    send(feed, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    settle(w)
    assert w.reason() == "the CURVE handshake failed: is server_public_key the daemon's public key?"
    send(feed, zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)
    settle(w)
    reason = w.reason()
    assert reason is not None and "ZAP status 400" in reason
    send(feed, zmq.EVENT_HANDSHAKE_SUCCEEDED)
    settle(w)
    assert w.reason() is None
