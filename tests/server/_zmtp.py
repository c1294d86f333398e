"""A DEALER that speaks ZMTP 3.0 (NULL mechanism) over a plain TCP socket, for tests.

A pyzmq socket's I/O thread drains replies from the kernel into its own queue
whether or not the application reads them, so a client that "does not read"
still empties the server's socket buffers.  This one reads nothing it is not
asked to: after a request, the reply stays in the kernel buffers (a small
``SO_RCVBUF`` on this side, the sender's send buffer on the other) and in the
server's in-flight accounting, as long as the test likes.  Spec: rfc.zeromq.org/spec/23.
"""

from __future__ import annotations

import socket
import struct


class RawDealer:
    """``send(frames)`` and ``recv()`` (one multipart message) over ZMTP 3.0."""

    def __init__(self, address: str, rcvbuf: int = 4096):
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: fixes the window
        self.sock.connect((host, int(port)))
        greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
        self.sock.sendall(greeting)
        peer = self._exact(64)
        if peer[:1] != b"\xff" or peer[10:11] != b"\x03":
            raise ConnectionError(f"not a ZMTP 3 peer: {peer[:12]!r}")
        name, value = b"Socket-Type", b"DEALER"
        ready = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
        self._frame(ready, command=True, more=False)
        flags, body = self._read_frame()
        if not flags & 0x04 or not body.startswith(b"\x05READY"):
            raise ConnectionError(f"expected the peer's READY, got flags {flags} {body[:16]!r}")

    def send(self, frames: list[bytes]) -> None:
        for i, frame in enumerate(frames):
            self._frame(frame, command=False, more=i < len(frames) - 1)

    def recv(self) -> list[bytes]:
        frames = []
        while True:
            flags, body = self._read_frame()
            frames.append(body)
            if not flags & 0x01:
                return frames

    def close(self) -> None:
        self.sock.close()

    def _frame(self, body: bytes, *, command: bool, more: bool) -> None:
        flags = (0x04 if command else 0) | (0x01 if more else 0)
        if len(body) < 256:
            head = bytes([flags, len(body)])
        else:
            head = bytes([flags | 0x02]) + struct.pack(">Q", len(body))
        self.sock.sendall(head + body)

    def _read_frame(self) -> tuple[int, bytes]:
        flags = self._exact(1)[0]
        size = struct.unpack(">Q", self._exact(8))[0] if flags & 0x02 else self._exact(1)[0]
        return flags, self._exact(size)

    def _exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("peer closed")
            out += chunk
        return bytes(out)
