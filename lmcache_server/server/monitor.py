"""Connected clients, from the ZeroMQ socket monitor of the server's ROUTER socket.

libzmq reports every accepted connection (``EVENT_ACCEPTED``) and every
closed one (``EVENT_DISCONNECTED``: the peer closed it, or the heartbeat
dropped it) on an inproc PAIR socket.  A task on the event loop reads those
events and keeps the set of open connections (by file descriptor, so an event
for a connection accepted before the monitor started cannot drive the count
below zero).  Failed handshakes (a refused CURVE key, a client without
CURVE keys) are counted by reason.  No thread of ours: libzmq's I/O thread
produces the events.

Primitives: :class:`ConnectionMonitor` (``start`` after the socket is bound,
``connected``, ``close`` before the socket closes).
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ..metrics import ServerMetrics

logger = logging.getLogger(__name__)

_HANDSHAKE_FAILURES: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth",  # ZAP refused the key
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",  # e.g. a client without CURVE keys
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "other",
}
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
for _event in _HANDSHAKE_FAILURES:
    _EVENTS |= _event


class ConnectionMonitor:
    """Counts a socket's open peer connections into the ``lmcache_*connect*`` metrics."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self._open: set[int] = set()
        self._sock: zmq.asyncio.Socket | None = None
        self._events: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def connected(self) -> int:
        """Connections open now."""
        return len(self._open)

    def start(self, sock: zmq.asyncio.Socket | None) -> None:
        """Watch ``sock`` (bound, on this event loop) until :meth:`close`."""
        if sock is None:
            raise RuntimeError("bind the socket before monitoring it")
        self._sock = sock
        self._events = sock.get_monitor_socket(_EVENTS)
        self._task = asyncio.get_running_loop().create_task(self._read(self._events))

    async def _read(self, events: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await events.recv_multipart())
            fd = int(event["value"])
            failure = _HANDSHAKE_FAILURES.get(event["event"])
            if failure is not None:
                self.metrics.handshake_failures.labels(failure).inc()
                logger.debug("handshake failed (%s) on %s", failure, event["endpoint"])
                continue
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._open.add(fd)
                self.metrics.connections.inc()
            elif fd in self._open:
                self._open.discard(fd)
                self.metrics.disconnections.inc()
            else:
                continue
            self.metrics.connected_clients.set(len(self._open))
            logger.debug("client event %s on %s; %d open", event["event"], event["endpoint"], len(self._open))

    async def close(self) -> None:
        """Stop watching; call before the monitored socket (and its context) closes."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._sock is not None and not self._sock.closed:
            self._sock.disable_monitor()
        if self._events is not None:
            self._events.close(linger=0)
            self._events = None
        self._sock = None
