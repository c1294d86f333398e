"""Client-side exceptions.

- ClientError: base class.
- ServerError: the daemon answered with an error reply (code + message).
- DaemonUnavailable: no reply within the timeout, or no connection.
- BadAddress: the daemon's address is no ZeroMQ endpoint (also a ValueError).
"""

from __future__ import annotations

from .protocol.codes import ErrorCode


class ClientError(Exception):
    """Base class of every exception the client raises."""


class ServerError(ClientError):
    """The daemon refused the request; ``code`` is the protocol error code."""

    def __init__(self, code: ErrorCode | int, message: str):
        name = code.name if isinstance(code, ErrorCode) else str(code)
        super().__init__(f"{name}: {message}")
        self.code = code
        self.message = message


class DaemonUnavailable(ClientError):
    """The daemon did not answer in time or cannot be reached."""


class BadAddress(ClientError, ValueError):
    """The daemon's address is no endpoint ZeroMQ can connect to (``localhost:65432``
    instead of ``tcp://localhost:65432``, an unknown transport): raised when the client
    is made, with the address and ZeroMQ's reason; nothing is left open."""
