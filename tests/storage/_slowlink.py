"""A TCP proxy with a slow link: bytes flow at a set rate in either direction (tests only)."""

from __future__ import annotations

import socket
import threading
import time


class SlowLink:
    """Forwards 127.0.0.1:``port`` (its own port: ``.port``); ``up_rate`` / ``down_rate``
    bytes per second towards / from the server (None: as fast as it goes).  The
    proxy's receive buffers are small, so little of a big send hides in them."""

    def __init__(self, port: int, up_rate: int | None = None, down_rate: int | None = None) -> None:
        self.upstream, self.up_rate, self.down_rate = port, up_rate, down_rate
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # inherited by accepted sockets
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            threading.Thread(target=self._pipe, args=(client, server, self.up_rate), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, self.down_rate), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, rate: int | None) -> None:
        try:
            while data := src.recv(64 * 1024):
                dst.sendall(data)
                if rate is not None:
                    time.sleep(len(data) / rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()
