"""One daemon per ipc:// socket (server/endpointlocks.py), against real daemon processes.

ZeroMQ binds an ipc:// endpoint by replacing the socket file, so without a lock a
second daemon on the same path took the first one's clients over silently.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest

from lmcache_client import PutStatus

from ..conftest import Daemon, free_port


def test_a_second_daemon_on_the_same_ipc_path_refuses_to_start(daemon_factory: Callable[..., Daemon]) -> None:
    first = daemon_factory()
    key = hashlib.sha256(b"ipc-lock").digest()
    with first.client(address=first.ipc_address) as c:
        assert c.put([key], [b"first" * 100]) == [PutStatus.STORED]
        port = free_port()  # the second daemon: its own tcp port, the first one's ipc path
        other = {"port": port, "listen": [f"tcp://127.0.0.1:{port}", first.ipc_address]}
        with pytest.raises(RuntimeError, match="exited with 2") as err:
            daemon_factory(**other)
        message = str(err.value)
        assert "refusing to start" in message and "'listen'" in message and first.ipc_address in message
        assert "another daemon serves it" in message and f"{first.ipc_address[len('ipc://') :]}.lock" in message
        # The first one keeps its socket and its clients: this one, and a new one.
        assert c.get([key]) == [b"first" * 100]
    with first.client(address=first.ipc_address) as c:
        assert c.get([key]) == [b"first" * 100]
    assert first.stop() == 0
    # Once the first one stopped, the path is free again.
    again = daemon_factory(**other)
    with again.client(address=first.ipc_address) as c:
        c.ping()
        assert c.get([key]) == [None]
    assert again.stop() == 0


def test_a_second_daemon_on_the_same_events_ipc_path_refuses_to_start(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    events = f"ipc://{tmp_path}/events.sock"
    first = daemon_factory(events_endpoint=events)
    with pytest.raises(RuntimeError, match="exited with 2") as err:
        daemon_factory(events_endpoint=events)
    assert "'events_endpoint'" in str(err.value) and "another daemon serves it" in str(err.value)
    with first.client() as c:
        c.ping()
