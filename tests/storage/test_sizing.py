"""The sizing telemetry's sketches (storage/sizing.py) and the store's hooks into them.

The HyperLogLog is fed seeded random 64-bit hashes, so its estimates here are
the same on every run; the windows hash real keys with Python's per-process
hash, and are checked where the sketch counts by linear counting (a few
distinct keys among thousands of registers), which is exact to a key or two.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import tracemalloc

import pytest

from lmcache_client.protocol import KEY_BYTES, PutStatus
from lmcache_server.storage import ChunkKey, MemoryPool, MemoryTier, TieredStore
from lmcache_server.storage.sizing import HyperLogLog, Sizing, SizingWindow, register_max, relative_error

from ..conftest import Closer

MiB = 1 << 20


def hashes(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


def keys(n: int) -> list[bytes]:
    return [os.urandom(KEY_BYTES) for _ in range(n)]


# -- the HyperLogLog ----------------------------------------------------------------------
@pytest.mark.parametrize("precision", [10, 12, 14])
@pytest.mark.parametrize("n", [20_000, 200_000])
def test_estimate_within_three_standard_errors(precision: int, n: int) -> None:
    hll = HyperLogLog(precision)
    for h in hashes(precision * 1000 + n, n):
        hll.add(h)
    assert abs(hll.estimate() - n) / n <= 3 * relative_error(precision)


def test_error_over_seeds_is_the_documented_one() -> None:
    """The root-mean-square relative error over 30 seeded key sets is about 1.04 / sqrt(m)."""
    precision, n = 10, 30_000
    errors = []
    for seed in range(30):
        hll = HyperLogLog(precision)
        for h in hashes(seed, n):
            hll.add(h)
        errors.append((hll.estimate() - n) / n)
    rms = math.sqrt(sum(e * e for e in errors) / len(errors))
    assert 0.4 * relative_error(precision) < rms < 1.5 * relative_error(precision)
    assert abs(sum(errors) / len(errors)) < relative_error(precision)  # no bias to speak of


def test_small_counts_are_near_exact_and_repeats_count_once() -> None:
    hll = HyperLogLog(12)
    distinct = hashes(7, 100)
    for _ in range(10):
        for h in distinct:
            hll.add(h)
    assert abs(hll.estimate() - 100) <= 2
    assert HyperLogLog(12).estimate() == 0.0


def test_union_counts_shared_hashes_once() -> None:
    a, b = HyperLogLog(12), HyperLogLog(12)
    shared, only_a, only_b = hashes(1, 30_000), hashes(2, 10_000), hashes(3, 10_000)
    for h in shared + only_a:
        a.add(h)
    for h in shared + only_b:
        b.add(h)
    assert abs(a.union_estimate(b) - 50_000) / 50_000 <= 3 * relative_error(12)
    with pytest.raises(ValueError, match="precision"):
        a.union_estimate(HyperLogLog(10))


def test_register_max_is_the_element_wise_max() -> None:
    """The union's registers, computed eight bits a lane on big integers, equal a
    plain max per register, at the extremes (0 and 61, the highest rank) too."""
    rng = random.Random(11)
    for n in (16, 4096):
        for _ in range(50):
            a = bytes(rng.choice([0, 1, 60, 61, rng.randrange(62)]) for _ in range(n))
            b = bytes(rng.choice([0, 1, 60, 61, rng.randrange(62)]) for _ in range(n))
            assert register_max(a, b) == bytes(map(max, a, b))


def test_memory_does_not_grow_with_keys() -> None:
    """The registers are fixed at 2**precision bytes; recording 10x more distinct keys
    allocates nothing that stays."""
    window = SizingWindow(1 << 30)
    many = keys(100_000)
    flags = [False] * len(many)
    window.record("ns", many[:1000], flags[:1000])
    size = len(window._current.registers)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(1000, len(many), 1000):
            window.record("ns", many[i : i + 1000], flags[i : i + 1000])
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(window._current.registers) == size == 16384
    assert kept < 4096  # 99,000 more keys: no per-key state
    assert abs(window.stats()["distinct"] - 100_000) / 100_000 <= 3 * relative_error(14)


@pytest.mark.parametrize("precision", [3, 19])
def test_precision_is_bounded(precision: int) -> None:
    with pytest.raises(ValueError, match="precision"):
        HyperLogLog(precision)


# -- the window -----------------------------------------------------------------------------
def test_ceiling_of_100_accesses_over_10_keys() -> None:
    window = SizingWindow(1000)
    ten = keys(10)
    rng = random.Random(5)
    seq = ten + [rng.choice(ten) for _ in range(90)]  # every key at least once, 100 accesses
    hits = [i >= 10 and i % 2 == 0 for i in range(100)]  # a tier that served 45 of them
    for i in range(0, 100, 7):  # batches of any size
        window.record("ns", seq[i : i + 7], hits[i : i + 7])
    s = window.stats()
    assert s["accesses"] == 100
    assert s["hits"] == 45
    assert s["actual"] == 0.45
    assert s["ceiling"] == pytest.approx(0.9, abs=0.02)  # linear counting: 10 distinct within 2
    # Namespaces keep equal digests apart.
    window.record("other", ten, [False] * 10)
    assert window.stats()["distinct"] == pytest.approx(20, abs=2)


def test_window_rotates_and_forgets() -> None:
    """Two windows of 50 accesses: the figures cover 50..100 accesses, and keys of
    an older window are forgotten."""
    window = SizingWindow(50)
    a, b = keys(10), keys(10)
    window.record("ns", [a[i % 10] for i in range(50)], [False] * 50)
    assert window.rotations == 1
    assert window.stats()["accesses"] == 50
    window.record("ns", [b[i % 10] for i in range(30)], [True] * 30)
    s = window.stats()
    assert (s["accesses"], s["hits"]) == (80, 30)
    assert s["distinct"] == pytest.approx(20, abs=2)  # both windows' keys
    assert s["ceiling"] == pytest.approx(60 / 80, abs=0.03)
    window.record("ns", [b[i % 10] for i in range(40)], [True] * 40)  # crosses a rotation inside the batch
    s = window.stats()
    assert window.rotations == 2
    assert (s["accesses"], s["hits"]) == (50 + 20, 70)  # a full window of b, 20 more: a is gone
    assert s["distinct"] == pytest.approx(10, abs=2)
    assert s["ceiling"] == pytest.approx(60 / 70, abs=0.03)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="window_chunks"):
        SizingWindow(0)
    with pytest.raises(ValueError, match="hit flags"):
        SizingWindow(10).record("ns", keys(3), [True])
    assert SizingWindow(10).stats() == {"accesses": 0, "hits": 0, "distinct": 0.0, "ceiling": 0.0, "actual": 0.0}


# -- the store's hooks ------------------------------------------------------------------
def test_store_records_lookups_and_gets(runner: asyncio.Runner, closed_at_end: Closer) -> None:
    """A lookup counts a memory hit only in its leading hit run; a get counts each
    distinct key of the batch once, a hit when memory served it."""

    async def run() -> None:
        memory = MemoryTier(MemoryPool(4 * MiB, "off"), max_pinned_bytes=0)
        store = closed_at_end(TieredStore(memory, sizing=Sizing(1000)))
        a, b, c = (os.urandom(KEY_BYTES) for _ in range(3))
        for digest in (a, c):
            assert await memory.put(ChunkKey("ns", digest), b"x" * 1000) == PutStatus.STORED
        hits, tiers = await store.lookup("ns", [a, b, c])
        assert (hits, tiers) == (1, ["memory", None, "memory"])
        assert store.lookup_now("ns", [a, c]) == (2, ["memory", "memory"])
        lookup = store.sizing.lookup.stats()
        assert (lookup["accesses"], lookup["hits"]) == (5, 3)  # c after the miss of b is no hit
        assert lookup["distinct"] == pytest.approx(3, abs=0.5)
        chunks = await store.get_many("ns", [a, b, c, a])
        for chunk in chunks:
            if chunk is not None:
                chunk.release()
        got = store.sizing.get.stats()
        assert (got["accesses"], got["hits"]) == (3, 2)  # a's repeat in the batch is not another access

    runner.run(run())
