"""One daemon per ``ipc://`` socket: a lock beside each socket file it binds.

ZeroMQ binds an ``ipc:///path`` endpoint by removing whatever socket file is at
``path`` and creating its own, so a second daemon with the same path would take
the first one's clients over without a word.  Before anything is built, the
daemon takes an exclusive lock on ``<path>.lock`` for every ``ipc://`` endpoint
it will bind (``listen`` and the KV-event endpoints) and holds it until it has
closed its sockets; a second daemon finds the lock held and refuses to start
(exit code 2) with one line naming the key, the endpoint and the lock file.
The mechanism is the spill directory's (:mod:`lmcache_server.filelock`).
Abstract sockets (``ipc://@name``) have no file, and the kernel itself refuses
a second bind of one, so they need no lock.

Primitives: :class:`EndpointLocks` (``take``, ``release``; a context manager),
:func:`ipc_path`, :func:`bound_endpoints`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

from ..config import ConfigError, ServerConfig
from ..filelock import LockHeld, hold_lock

__all__ = ["EndpointLocks", "bound_endpoints", "ipc_path"]

LOCK_SUFFIX = ".lock"


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an ``ipc://`` endpoint; None for tcp and abstract sockets."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://") :]
    return None if path.startswith("@") else Path(path)


def bound_endpoints(config: ServerConfig) -> list[tuple[str, str]]:
    """Every endpoint the daemon binds, with its config key."""
    out = [("listen", address) for address in config.listen]
    for key in ("events_endpoint", "events_replay_endpoint", "events_snapshot_endpoint"):
        endpoint = getattr(config, key)
        if endpoint is not None and config.events_endpoint is not None:
            out.append((key, endpoint))
    return out


class EndpointLocks:
    """The locks of one daemon's ``ipc://`` endpoints, held until :meth:`release`."""

    def __init__(self, fds: list[int]):
        self._fds = fds

    @classmethod
    def take(cls, endpoints: Iterable[tuple[str, str]]) -> EndpointLocks:
        """Lock every ``ipc://`` endpoint of ``endpoints`` ((config key, endpoint)
        pairs); raises :class:`ConfigError` (nothing held) when one is another
        daemon's or its lock file cannot be made."""
        fds: list[int] = []
        try:
            for key, endpoint in endpoints:
                path = ipc_path(endpoint)
                if path is None:
                    continue
                lock = path.with_name(path.name + LOCK_SUFFIX)
                try:
                    fds.append(hold_lock(lock))
                except LockHeld:
                    raise ConfigError(
                        key,
                        endpoint,
                        f"a socket path no other daemon uses (another daemon serves it: it holds {lock};"
                        " give each daemon its own path)",
                    ) from None
                except OSError as err:
                    raise ConfigError(
                        key, endpoint, f"a socket path in a directory this user can write ({lock}: {err.strerror})"
                    ) from None
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return cls(fds)

    def release(self) -> None:
        """Let another daemon bind these paths (call it once the sockets are closed)."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __enter__(self) -> EndpointLocks:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.release()
