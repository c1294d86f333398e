"""The compact key history (storage/policy/history.py) and what the policies built on it keep of their behaviour."""

from __future__ import annotations

import asyncio
import collections
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lmcache_server.storage.base import ChunkKey
from lmcache_server.storage.disk import DiskTier
from lmcache_server.storage.policy import LFUDAPolicy, adaptive
from lmcache_server.storage.policy.adaptive import AdaptivePolicy
from lmcache_server.storage.policy.history import KeyHistory, key_hash

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from _harness import write_chunk_files  # noqa: E402
from policy_sim import (  # noqa: E402
    DEFAULT_TRACE,
    CacheModel,
    distinct_blocks,
    load_trace,
    replay_model,
    synthetic_requests,
    trace_keys,
)

from ._traces import trace_present  # noqa: E402


def test_add_pop_contains_and_values() -> None:
    h = KeyHistory(100)
    h.add(5, 3)
    h.add(7, 1 << 40)  # capped, not wrapped
    assert 5 in h and 7 in h and 9 not in h and len(h) == 2
    assert h.pop(7) == (1 << 16) - 1
    assert h.pop(5) == 3 and h.pop(5) == 0 and len(h) == 0
    assert 0 not in h and "5" not in h
    h.add(0, 2)  # hash 0 is a key like any other
    assert 0 in h and h.pop(0) == 2


def test_a_small_history_forgets_exactly_oldest_first() -> None:
    h = KeyHistory(16, with_values=False)
    for i in range(1, 41):
        h.add(i * 0x9E3779B97F4A7C15)
        assert len(h) == min(i, 16)
    assert [i for i in range(1, 41) if i * 0x9E3779B97F4A7C15 in h] == list(range(25, 41))


def test_at_scale_it_keeps_the_recent_keys() -> None:
    limit = 40_000
    h = KeyHistory(limit)
    rng = random.Random(3)
    keys = [rng.getrandbits(64) for _ in range(5 * limit)]
    for i, k in enumerate(keys):
        h.add(k, 1 + i % 7)
    assert len(h) <= limit + 15
    newest_half = keys[-limit // 2 :]
    kept_half = sum(k in h for k in newest_half) / len(newest_half)
    kept_all = sum(k in h for k in keys[-limit:]) / limit
    assert kept_half > 0.99 and kept_all > 0.85, (kept_half, kept_all)  # an exact FIFO: 1.0 and 1.0
    old = keys[: -2 * limit]
    assert sum(k in h for k in old) <= len(old) // 1000  # and next to nothing older (a bucket few keys reached)
    assert h.nbytes <= 7 * (limit + 16)  # 6 bytes a key


def test_growing_keeps_what_it_had_and_its_bytes_stay_bounded() -> None:
    h = KeyHistory(1000)
    old = list(range(1, 1001))
    for k in old:
        h.add(k * 7919, 1)
    held = [k for k in old if k * 7919 in h]
    assert len(held) > 900
    h.bound(10_000)
    assert all(k * 7919 in h for k in held) and len(h) == len(held)  # still searched in the old table
    new = [k * 104729 for k in range(1, 30_001)]
    for k in new:
        h.add(k, 2)
    assert not any(k * 7919 in h for k in old)  # the old table was dropped once the new one took as many
    assert len(h) <= 11_264 and h.nbytes <= 7 * 11_264
    h.bound(100)  # a lower bound keeps the table
    assert len(h) > 10_000


def test_key_hash_is_the_same_in_every_process() -> None:
    keys = [ChunkKey("model-a|bf16", bytes([i]) * 32) for i in range(4)] + [ChunkKey("ns", b"a")]
    code = (
        "from lmcache_server.storage.base import ChunkKey;"
        "from lmcache_server.storage.policy.history import key_hash;"
        "import sys;"
        "print([key_hash(ChunkKey(ns, bytes.fromhex(d))) for ns, d in "
        f"{[(k.namespace, k.digest.hex()) for k in keys]!r}])"
    )
    out = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": seed}
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert out == {str([key_hash(k) for k in keys])}
    assert len({key_hash(k) for k in keys}) == len(keys)
    assert key_hash(ChunkKey("a", b"x" * 32)) != key_hash(ChunkKey("b", b"x" * 32))


class _ExactHistory:
    """The history as it was before: an OrderedDict of hashes, oldest popped beyond the limit."""

    def __init__(self) -> None:
        self.d: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.limit = 0

    def bound(self, limit: int) -> None:
        self.limit = limit

    def add(self, h: int, value: int = 1) -> None:
        self.d[h] = value
        self.d.move_to_end(h)
        while len(self.d) > self.limit:
            self.d.popitem(last=False)

    def pop(self, h: int) -> int:
        return self.d.pop(h, 0)

    def __contains__(self, h: object) -> bool:
        return h in self.d

    def __len__(self) -> int:
        return len(self.d)


def _requests(n: int) -> list[Any]:
    return load_trace(DEFAULT_TRACE, n) if trace_present() else synthetic_requests(n)


def _hit_rate(requests: list[Any], capacity: int, policy: Any) -> float:
    return replay_model(requests, CacheModel(capacity, policy), trace_keys(requests)).token_hit_rate


@pytest.mark.parametrize("pct", [2, 10])
def test_lfuda_with_the_compact_history_hits_as_with_the_exact_one(pct: int) -> None:
    requests = _requests(4000)
    capacity = max(64, distinct_blocks(requests) * pct // 100)
    compact = LFUDAPolicy(min_ghost=64)
    exact = LFUDAPolicy(min_ghost=64)
    exact._ghost = _ExactHistory()  # type: ignore[assignment]
    a, b = _hit_rate(requests, capacity, compact), _hit_rate(requests, capacity, exact)
    assert b > 0.02 and abs(a - b) <= 0.005, (a, b)


def test_sampled_experts_decide_as_the_exact_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 1M chunks the experts model 1 key in 64; here 1 in 4 at a capacity where the
    head rule pays (2%) and one where it does not (10%): the hit rates stay close."""
    requests = _requests(6000)
    distinct = distinct_blocks(requests)
    for pct in (2, 10):
        capacity = distinct * pct // 100
        exact = _hit_rate(requests, capacity, AdaptivePolicy(capacity))
        monkeypatch.setattr(adaptive, "_MIN_SAMPLED", max(16, capacity // 4))
        sampled_policy = AdaptivePolicy(capacity)
        sampled = _hit_rate(requests, capacity, sampled_policy)
        monkeypatch.undo()
        assert sampled_policy._sample_bits == 2
        assert sampled_policy._all.order.chunks <= capacity // 4 + 1
        assert abs(sampled - exact) <= 0.01, (pct, sampled, exact)


def test_a_snapshot_round_trip_at_scale_keeps_every_entry(tmp_path: Path) -> None:
    n = 20_000
    write_chunk_files(tmp_path, n, "scale|ns", payload_bytes=100)
    # and a second namespace, another size
    write_chunk_files(tmp_path, n + 500, "scale|other", payload_bytes=5000, start=n)

    async def opened() -> tuple[dict[ChunkKey, tuple[int, int]], int, DiskTier]:
        tier = DiskTier(tmp_path, 1 << 40)
        await tier.open()
        index = {k: (e.payload_len, e.disk_bytes) for k, e in tier.index.entries.items()}
        return index, tier.counters.rebuilt_from_snapshot, tier

    async def run() -> None:
        scanned, from_snapshot, tier = await opened()
        try:  # its close writes the snapshot the second tier reads
            assert from_snapshot == 0 and len(scanned) == n + 500
            before = tier.stats()
        finally:
            await tier.close()
        loaded, from_snapshot, tier = await opened()
        try:
            assert from_snapshot == 1 and loaded == scanned
            after = tier.stats()
            for field in ("stored_bytes", "disk_bytes", "chunks"):
                assert after[field] == before[field]
            assert tier.namespaces() == {"scale|ns": (n, 100 * n), "scale|other": (500, 5000 * 500)}
            # one namespace string per namespace, not one per entry
            assert len({id(k.namespace) for k in tier.index.entries}) == 2
            got = await tier.get(ChunkKey("scale|other", (n + 7).to_bytes(32, "little")))
            assert got is not None and got.nbytes == 5000
        finally:
            await tier.close()

    asyncio.run(run())
