"""The sizing telemetry through the real daemon: the hit-rate ceiling beside the actual
hit rate on /metrics (storage/sizing.py, docs/operations.md "Would a bigger pool help?").

A client plays an engine: for each chunk it looks it up, gets it, and puts it
when it was missing.  16 chunks of 256 KiB, read in turn 5 times (80 accesses):
an unbounded tier misses only the 16 first reads, so the ceiling is 64 / 80 =
0.8.  A pool that holds all 16 reaches it; a 2 MiB LRU pool (8 chunks) read in
a cycle of 16 never hits.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from lmcache_client import PutStatus
from lmcache_client.protocol import KEY_BYTES
from lmcache_server.config import ConfigError, load_config

from ..conftest import Daemon
from .test_metrics import sample, scrape

KiB = 1 << 10
CHUNKS, ROUNDS = 16, 5


def play(daemon: Daemon) -> str:
    """The engine's reads of the module docstring; the /metrics text after them."""
    keys = [os.urandom(KEY_BYTES) for _ in range(CHUNKS)]
    data = [os.urandom(256 * KiB) for _ in keys]
    with daemon.client() as c:
        for _ in range(ROUNDS):
            for key, payload in zip(keys, data):
                c.lookup([key])
                [got] = c.get([key])
                if got is None:
                    assert c.put([key], [payload]) == [PutStatus.STORED]
                else:
                    assert bytes(got) == payload
    return scrape(daemon.metrics_port)


def rates(text: str, op: str) -> tuple[float, float, float]:
    ceiling = sample(text, "lmcache_hit_rate_ceiling_ratio", op=op)
    actual = sample(text, "lmcache_hit_rate_window_ratio", op=op)
    accesses = sample(text, "lmcache_hit_rate_window_accesses", op=op)
    assert ceiling is not None and actual is not None and accesses is not None, text
    return ceiling, actual, accesses


def test_small_pool_falls_short_of_the_ceiling(daemon_factory: Callable[..., Daemon]) -> None:
    text = play(daemon_factory(max_local_cpu_size="2MiB", cache_policy="lru"))
    for op in ("lookup", "get"):
        ceiling, actual, accesses = rates(text, op)
        assert accesses == CHUNKS * ROUNDS
        assert ceiling == pytest.approx(0.8, abs=0.02)  # 16 distinct of 80, counted by the sketch
        assert actual < 0.1  # a cycle of 16 through an LRU of 8: every read misses
        distinct = sample(text, "lmcache_hit_rate_window_distinct_chunks", op=op)
        assert distinct == pytest.approx(CHUNKS, abs=1.5)
    assert (sample(text, "lmcache_tier_evictions_total", tier="memory") or 0) >= CHUNKS
    assert sample(text, "lmcache_hit_rate_sketch_error_ratio") == pytest.approx(0.0081, abs=0.0001)


def test_pool_that_holds_the_working_set_reaches_the_ceiling(daemon_factory: Callable[..., Daemon]) -> None:
    text = play(daemon_factory(cache_policy="lru"))  # 64 MiB
    for op in ("lookup", "get"):
        ceiling, actual, accesses = rates(text, op)
        assert accesses == CHUNKS * ROUNDS
        assert actual == 0.8  # exactly the first reads missed
        assert ceiling == pytest.approx(actual, abs=0.02)
    assert sample(text, "lmcache_tier_evictions_total", tier="memory") == 0.0


def test_sizing_off(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory(sizing_window_chunks=0)
    with daemon.client() as c:
        c.lookup([os.urandom(KEY_BYTES)])
    text = scrape(daemon.metrics_port)
    assert "lmcache_hit_rate_" not in text
    assert sample(text, "lmcache_lookup_chunks_total") == 1.0


@pytest.mark.parametrize("value", [-1, "big", 1.5, True])
def test_window_is_validated(value: object) -> None:
    with pytest.raises(ConfigError, match="sizing_window_chunks"):
        load_config(environ={}, overrides={"sizing_window_chunks": value})
    assert load_config(environ={}).sizing_window_chunks == 1 << 20
    assert load_config(environ={"LMCACHE_SIZING_WINDOW_CHUNKS": "5000"}).sizing_window_chunks == 5000
