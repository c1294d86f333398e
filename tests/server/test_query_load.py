"""``POST /query`` never holds the event loop, and the HTTP endpoint is bounded
(issue 39 item 4; docs/events.md, "Query"), against the real daemon:

- a 0.8 MB body over 16 namespaces of one token a chunk (``c1``; before, it
  also came with ``chunk_size: 1`` in the body) is answered while ZeroMQ pings
  sent every 10 ms all answer within 100 ms (before: the loop was held for
  seconds, hashing 16 x 100,000 chunks up front);
- a walk through held chunks lets other tasks run while it goes on and
  stops after ``MAX_STEPS`` chunk steps (the namespaces left say ``truncated``);
- connections beyond the cap, and queries beyond theirs, get a 503 at once
  instead of queueing, and the endpoint serves again once they are gone.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from lmcache_client.keys import chunk_keys
from lmcache_client.protocol import PutStatus
from lmcache_server.security.querytokens import QueryAccess, QueryScope
from lmcache_server.server.http import MAX_CONNECTIONS, MAX_QUERIES
from lmcache_server.server.query import MAX_STEPS, MAX_TOKENS, Query

from ..conftest import Daemon

MODEL = "load-model"
NAMESPACES = [f"{MODEL}|float16|L1|KV1|D8|tp0of1|c1|n{i}" for i in range(16)]
PING_BOUND_S = 0.1
"""The issue's bound for a ZeroMQ request while a query is answered (the host is loaded:
the daemon's own share of a ping is well under a millisecond)."""


def post(port: int, body: bytes, timeout_s: float = 120) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", "/query", body=body, headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read() or b"null")
    finally:
        conn.close()


def pings_during(daemon: Daemon, work: Callable[[], Any]) -> tuple[Any, list[float]]:
    """``work()``'s result and the round trips of pings sent every 10 ms while it ran."""
    done = threading.Event()
    latencies: list[float] = []

    def ping() -> None:
        with daemon.client() as c:
            c.ping(timeout_s=30)  # connected before the work starts
            started.set()
            while not done.is_set():
                t0 = time.perf_counter()
                c.ping(timeout_s=30)
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.01)

    started = threading.Event()
    pinger = threading.Thread(target=ping)
    pinger.start()
    try:
        assert started.wait(20)
        result = work()
    finally:
        done.set()
        pinger.join(60)
    return result, latencies


@pytest.fixture(scope="module")
def node(module_daemon_factory: Callable[..., Daemon]) -> Daemon:
    """16 namespaces of model MODEL at one token a chunk, each holding the first chunk of
    the prompt below (so each walk goes one step, then misses)."""
    daemon = module_daemon_factory()
    tokens = prompt()
    first = chunk_keys(tokens[:1], 1)
    for ns in NAMESPACES:
        with daemon.client(namespace=ns) as c:
            assert c.put(first, [os.urandom(64)]) == [PutStatus.STORED]
    return daemon


def prompt() -> list[int]:
    return list(range(100_000, 200_000))  # 100,000 six-digit ids: a 0.8 MB body


def test_a_large_query_over_many_namespaces_leaves_the_loop_free(node: Daemon) -> None:
    body = json.dumps({"model": MODEL, "tokens": prompt()}).encode()
    assert len(body) >= 800_000
    (status, answer), latencies = pings_during(node, lambda: post(node.metrics_port, body))
    assert status == 200, answer
    assert len(answer["namespaces"]) == 16
    assert {e["prefix_tokens"] for e in answer["namespaces"]} == {1}  # one chunk each, then a miss
    assert latencies and max(latencies) < PING_BOUND_S, f"max ping {max(latencies) * 1000:.0f} ms"


def test_a_chunk_size_in_the_body_is_refused_without_holding_the_loop(node: Daemon) -> None:
    body = json.dumps({"model": MODEL, "tokens": prompt(), "chunk_size": 1}).encode()
    (status, answer), latencies = pings_during(node, lambda: post(node.metrics_port, body))
    assert status == 400 and "chunk_size" in answer["error"]
    assert latencies and max(latencies) < PING_BOUND_S, f"max ping {max(latencies) * 1000:.0f} ms"


def _open_idle(port: int, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]


def _get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


def test_connections_beyond_the_cap_are_told_busy(node: Daemon) -> None:
    idle = _open_idle(node.metrics_port, MAX_CONNECTIONS)
    try:
        time.sleep(0.5)  # the daemon has accepted them all
        assert _get(node.metrics_port, "/healthz") == 503
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 10
    while _get(node.metrics_port, "/healthz") != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_queries_beyond_the_cap_are_told_busy_before_their_body_is_read(node: Daemon) -> None:
    slow = _open_idle(node.metrics_port, MAX_QUERIES)
    try:
        for s in slow:  # announce a body and send none of it: each holds a query slot
            s.sendall(b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        time.sleep(0.5)
        status, answer = post(node.metrics_port, json.dumps({"model": MODEL, "tokens": [1]}).encode())
        assert status == 503 and "busy" in answer["error"]
        assert _get(node.metrics_port, "/healthz") == 200  # the other endpoints still answer
    finally:
        for s in slow:
            s.close()
    deadline = time.monotonic() + 10
    while post(node.metrics_port, json.dumps({"model": MODEL, "tokens": [100_000]}).encode())[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_walk_through_held_chunks_yields_to_the_loop_and_stops_at_its_budget() -> None:
    """Every chunk held (the worst case: no miss ends the walks): the loop runs other tasks
    while the walk goes on, and the query stops after MAX_STEPS chunk steps in all."""
    walked_at: list[float] = []

    def where(key: Any) -> str:
        walked_at.append(time.perf_counter())
        return "memory"

    query = Query(where, lambda: NAMESPACES, 256, QueryAccess(None, QueryScope("t", admin=True), ""))
    body = json.dumps({"model": MODEL, "tokens": list(range(MAX_TOKENS))}).encode()

    async def run() -> tuple[dict[str, Any], list[float]]:
        ticks: list[float] = []

        async def tick() -> None:
            while True:
                await asyncio.sleep(0.001)
                ticks.append(time.perf_counter())

        ticker = asyncio.create_task(tick())
        try:
            answer = await query.answer(body, QueryScope("t", admin=True))
        finally:
            ticker.cancel()
        return answer, ticks

    answer, ticks = asyncio.run(run())
    walked = [e["prefix_tokens"] for e in answer["namespaces"]]
    assert walked == [MAX_STEPS] + [0] * 15  # one token a chunk: one step per token
    assert all(e["truncated"] for e in answer["namespaces"])
    # Counted, not timed: a walk that never yields lets no tick in between its first and
    # last lookup; this one (131,072 lookups, a slice every 2 ms) lets in dozens or more.
    during = [t for t in ticks if walked_at[0] < t < walked_at[-1]]
    assert len(during) >= 10, f"{len(during)} ticks during a walk of {walked_at[-1] - walked_at[0]:.2f} s"
