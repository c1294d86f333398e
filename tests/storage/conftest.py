"""Fixtures of the storage tests: a Redis cluster of three real redis-server nodes.

``redis_cluster`` (module scope) starts three cluster-enabled nodes on free port pairs
(the node's port and its cluster-bus port + 10000) and joins them with ``redis-cli
--cluster create``; the Redis tier and the batched-read tests use it.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

from ..conftest import RedisServer


def free_cluster_port() -> int:
    """A free port whose cluster-bus port (port + 10000) is valid and free too."""
    import random

    for _ in range(200):
        port = random.randint(20000, 30000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
                return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisServer]]:
    """Three cluster-enabled redis-server nodes joined with redis-cli --cluster create."""
    base = tmp_path_factory.mktemp("cluster")
    nodes = [
        RedisServer(
            base / f"n{i}",
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            f"nodes-{i}.conf",
            port=free_cluster_port(),
        )  # fmt: skip
        for i in range(3)
    ]
    try:
        for node in nodes:
            node.start()
        addresses = [f"127.0.0.1:{n.port}" for n in nodes]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            out = subprocess.run(["redis-cli", "-p", str(nodes[0].port), "cluster", "info"],
                                 capture_output=True, text=True, timeout=10).stdout  # fmt: skip
            if "cluster_state:ok" in out:
                break
            assert time.monotonic() < deadline, f"cluster never became ok: {out}"
            time.sleep(0.1)
        yield nodes
    finally:
        for node in nodes:
            node.stop()
