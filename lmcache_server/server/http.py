"""A minimal HTTP endpoint on the event loop: /metrics, /healthz, /readyz, POST /query.

No thread, no framework: Prometheus and probes send tiny GET requests.

- ``/metrics``: Prometheus text format from the injected registry.
- ``/healthz``: 200 while the process runs its event loop.
- ``/readyz``: 200 once every tier is initialised and the sockets are bound;
  503 before that and while draining.
- ``POST /query``: the longest prefix of some
  token ids this node holds, per medium (:mod:`.query`); a JSON answer, or a
  JSON ``{"error"}`` with a 4xx status.

Bounded, answering "busy" instead of queueing: at most :data:`MAX_CONNECTIONS`
connections at once (one more gets a 503 and is closed unread), and at most
:data:`MAX_QUERIES` queries (another gets a 503 before its body is read), so
buffered query bodies hold at most ``MAX_QUERIES x MAX_BODY`` bytes.  A query's
caller is checked (``Authorization``) before its body is read.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ..config import ConfigError
from .query import MAX_BODY, Query, QueryError

logger = logging.getLogger(__name__)

_MAX_REQUEST_BYTES = 8192
MAX_CONNECTIONS = 64
"""Connections served at once (probes and Prometheus need a few)."""
MAX_QUERIES = 2
"""``POST /query`` requests being read or answered at once."""
_LINGER_S = 1.0
"""How long a reply waits for the client to finish sending before the close."""


class HttpEndpoint:
    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        ready: Callable[[], bool],
        query: Query | None = None,
    ):
        self.query = query
        self.host = host
        self.port = port
        self.registry = registry
        self.ready = ready
        self._server: asyncio.Server | None = None
        self._connections = 0
        self._queries = 0

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._handle, self.host, self.port)
        except OSError as err:
            raise ConfigError("metrics_port", self.port, f"a free port on {self.host} ({err.strerror})") from None

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._connections >= MAX_CONNECTIONS:
            await self._reply(writer, "503 Service Unavailable", "text/plain", b"busy: too many connections\n")
            return
        self._connections += 1
        try:
            status, ctype, body = await self._serve(reader)
            await self._reply(writer, status, ctype, body, reader)
        finally:
            self._connections -= 1

    async def _serve(self, reader: asyncio.StreamReader) -> tuple[str, str, bytes]:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
            if len(head) > _MAX_REQUEST_BYTES:
                raise ValueError("request too large")
            method, path, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            path = path.split("?", 1)[0]
            if method == "POST" and path == "/query":
                status, ctype, body = await self._query(head, reader)
            else:
                status, ctype, body = self._route(method, path)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError):
            status, ctype, body = "400 Bad Request", "text/plain", b"bad request\n"
        except Exception:  # every request one reply; the endpoint keeps serving
            logger.exception("unhandled error in the HTTP endpoint")
            status, ctype, body = "500 Internal Server Error", "text/plain", b"internal error\n"
        return status, ctype, body

    @staticmethod
    async def _reply(
        writer: asyncio.StreamWriter,
        status: str,
        ctype: str,
        body: bytes,
        reader: asyncio.StreamReader | None = None,
    ) -> None:
        """Send the reply and close; with ``reader``, first read (and drop) what the client
        still sends, briefly: closing with an unread body resets the connection and the
        client may lose the reply (a refusal answered before its body was read)."""
        try:
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            if reader is not None and writer.can_write_eof():
                writer.write_eof()
                await asyncio.wait_for(_discard(reader, MAX_BODY), timeout=_LINGER_S)
        except (ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()

    async def _query(self, head: bytes, reader: asyncio.StreamReader) -> tuple[str, str, bytes]:
        if self.query is None:
            return _error("404 Not Found", "this endpoint does not serve /query")
        headers: dict[bytes, str] = {}
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().decode("latin-1")
        try:
            scope = self.query.scope(headers.get(b"authorization"))
        except QueryError as err:
            return _error(err.status, str(err))
        if b"content-length" not in headers:
            return _error("411 Length Required", "a query needs a Content-Length")
        length = int(headers[b"content-length"])  # ValueError: a 400
        if length < 0 or length > MAX_BODY:
            return _error("413 Payload Too Large", f"a query body is at most {MAX_BODY} bytes")
        if self._queries >= MAX_QUERIES:
            return _error("503 Service Unavailable", f"busy: {MAX_QUERIES} queries are being answered; ask again")
        self._queries += 1
        try:
            body = await asyncio.wait_for(reader.readexactly(length), timeout=10)
            answer = await self.query.answer(body, scope)
        except QueryError as err:
            return _error(err.status, str(err))
        finally:
            self._queries -= 1
        return "200 OK", "application/json", json.dumps(answer).encode()

    def _route(self, method: str, path: str) -> tuple[str, str, bytes]:
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"only GET\n"
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest(self.registry)
        if path == "/healthz":
            return "200 OK", "text/plain", b"ok\n"
        if path == "/readyz":
            if self.ready():
                return "200 OK", "text/plain", b"ready\n"
            return "503 Service Unavailable", "text/plain", b"not ready\n"
        return "404 Not Found", "text/plain", b"not found\n"


async def _discard(reader: asyncio.StreamReader, limit: int) -> None:
    while limit > 0 and (data := await reader.read(min(limit, 1 << 16))):
        limit -= len(data)


def _error(status: str, message: str) -> tuple[str, str, bytes]:
    return status, "application/json", json.dumps({"error": message}).encode() + b"\n"
