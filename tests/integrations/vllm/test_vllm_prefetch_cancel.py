"""A request that ends before its load gives up the daemon's prefetch for it (issue 30
item 5): the scheduler connector sends a lookup with ``cancel_prefetch`` on each rank's
lane, and the real daemon cancels the prefetch (its chunks come from Redis behind a slow
link, so the prefetch is still running).  Nothing here asserts on wall-clock time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("torch")

from lmcache_client import chunk_keys  # noqa: E402

from ...conftest import Daemon, RedisServer, wait_for  # noqa: E402
from ...storage._slowlink import SlowLink  # noqa: E402
from .vllm_harness.engine import Engine, Request  # noqa: E402

PROMPT = list(range(4000, 4041))  # 5 full chunks of 8 + 1 (1 KiB each)


def prefetch_stats(daemon: Daemon) -> dict[str, Any]:
    with daemon.client() as c:
        return dict(c.stats()["prefetch"])


def test_a_request_ended_before_its_load_cancels_its_prefetch(
    daemon_factory: Callable[..., Daemon], redis_server: RedisServer
) -> None:
    fast = daemon_factory(remote_url=redis_server.url)
    a = Engine(fast.address, "cancel")
    try:
        a.prefill("a", PROMPT)  # 5 chunks into memory and Redis
        with fast.client() as c:
            wait_for(lambda: (r := c.stats()["tiers"]["redis"])["stores"] >= 5 and r["queued_writes"] == 0)
    finally:
        a.scheduler.shutdown()
        a.worker.shutdown()
    assert fast.stop() == 0
    link = SlowLink(redis_server.port, down_rate=1024)  # 1 KiB/s: a chunk a second
    daemon = daemon_factory(remote_url=f"redis://127.0.0.1:{link.port}", remote_timeout_s=60)
    b = Engine(daemon.address, "cancel")
    try:
        side = b.scheduler.scheduler
        assert side is not None and side.lookups is not None
        namespace = b.worker.worker.transfer.namespace  # type: ignore[union-attr]
        with daemon.client() as c:
            wait_for(lambda: c.stats()["tiers"]["redis"]["up"])
            assert c.lookup(chunk_keys(PROMPT, 8), namespace=namespace).tiers == ["redis"] * 5
        request = Request("gone", PROMPT)
        assert b.ask(request) == 40  # the lookup, with prefetch: Redis chunks start moving up
        wait_for(lambda: prefetch_stats(daemon)["held_bytes"] > 0)
        # The request ends (an abort) while it waits for blocks: vLLM calls request_finished.
        assert b.scheduler.request_finished(request, []) == (False, None)
        stats = wait_for(lambda: (s := prefetch_stats(daemon))["cancelled"] == 1 and not s["running"] and s)
        assert stats["held_bytes"] == 0
        assert side.lookups.cancelled_prefetches == 1
        # A request whose load was emitted keeps its prefetch: nothing more is cancelled.
        kept = Request("kept", PROMPT)
        assert b.ask(kept) == 40
        run = b.prefill("kept2", PROMPT)
        assert run["external"] == 40
        assert side.lookups.cancelled_prefetches == 1
    finally:
        b.scheduler.shutdown()
        b.worker.shutdown()
        link.close()
