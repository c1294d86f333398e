"""Eviction policies: unit behaviour, the offline model, and the daemon replaying a trace.

The replay tests run the real daemon (``daemon_factory``) on a slice of the
Mooncake trace (``../shared/traces``; a synthetic prefix-tree workload where
the trace is not checked out) and check that its hit counts equal the offline
model's for the same policy and that its lookup counters equal the replay's
ground truth.
"""

from __future__ import annotations

import asyncio
import random
import re
import sys
import urllib.request
from pathlib import Path

import pytest

from lmcache_server.config import ConfigError, ServerConfig, load_config
from lmcache_server.storage import ChunkKey
from lmcache_server.storage.disk import DiskTier
from lmcache_server.storage.policy import POLICIES, LFUDAPolicy, LRUPolicy, make_policy

from ...conftest import Closer

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

from policy_sim import (  # noqa: E402
    BLOCK_TOKENS,
    DEFAULT_TRACE,
    NAMESPACE,
    CacheModel,
    Request,
    belady,
    distinct_blocks,
    hit_tokens,
    load_trace,
    replay_model,
    simulate,
    synthetic_requests,
    trace_keys,
)
from replay_trace import replay  # noqa: E402

from ._traces import require_trace, trace_present  # noqa: E402


def key(i: int) -> ChunkKey:
    return ChunkKey("ns", i.to_bytes(32, "big"))


def never(k: ChunkKey) -> bool:
    return False


def fill(model: CacheModel, ids: list[int], batch: bool = False) -> None:
    keys = [key(i) for i in ids]
    if batch:
        model.put(keys)
    else:
        for k in keys:
            model.put([k])


# -- LRU -----------------------------------------------------------------------------------------
def test_lru_order_touch_and_skip() -> None:
    p = LRUPolicy()
    for i in range(4):
        p.inserted(key(i), 1, None)
    p.touched(key(0))
    assert p.victim(never) == key(1)
    assert p.victim(lambda k: k == key(1)) == key(2)
    p.removed(key(1))
    assert p.victim(never) == key(2) and len(p) == 3


# -- LFUDA ---------------------------------------------------------------------------------------
def test_lfuda_one_offs_leave_oldest_first() -> None:
    model = CacheModel(4, LFUDAPolicy())
    fill(model, list(range(10)))
    assert model.held == {key(i) for i in range(6, 10)}


def test_lfuda_reused_chunk_outlives_one_offs_but_ages_out() -> None:
    model = CacheModel(8, LFUDAPolicy())
    fill(model, [100])
    for _ in range(3):
        model.get([key(100)])  # frequency 4
    survived = 0
    for i in range(200):
        fill(model, [i])
        if key(100) not in model.held:
            break
        survived += 1
    # It outlives many one-offs (LRU would drop it after 8 puts) ...
    assert survived > 16
    # ... but dynamic aging evicts it once it stops being read.
    assert survived < 200


def test_lfuda_history_remembers_evicted_frequency() -> None:
    policy = LFUDAPolicy()
    model = CacheModel(4, policy)
    fill(model, [1])
    model.get([key(1)])
    model.get([key(1)])
    fill(model, list(range(10, 30)))
    assert key(1) not in model.held
    fill(model, [1])  # back: it enters with its old count, above the one-offs
    fill(model, list(range(30, 36)))
    assert key(1) in model.held


def test_lfuda_history_is_bounded() -> None:
    policy = LFUDAPolicy(ghost_factor=2, min_ghost=16)
    model = CacheModel(4, policy)
    fill(model, list(range(500)))
    assert len(policy._ghost) == 16
    assert policy.chunks == 4


def test_lfuda_tails_leave_before_heads() -> None:
    chain = [key(i) for i in range(4)]
    held = {}
    for name in ("lru", "lfuda"):
        model = CacheModel(6, make_policy(name))
        fill(model, [0, 1, 2, 3], batch=True)  # one chain: 0 <- 1 <- 2 <- 3
        fill(model, [10, 11], batch=True)
        fill(model, [20, 21, 22], batch=True)  # three victims
        held[name] = model.lookup(chain), key(3) in model.held
    # LRU drops the chain's head first: its tail stays, an orphan no lookup can reach.
    assert held["lru"] == (0, True)
    # lfuda drops tails first: the two put tails (3, 11), then the deepest chunk
    # left (2); the head still saves two chunks of prefill.
    assert held["lfuda"] == (2, False)


def test_lfuda_put_tail_leaves_before_an_older_one_off() -> None:
    # depth_penalty=0 isolates the put-tail rule from the depth tie-break.
    held = {}
    for tails_first in (False, True):
        model = CacheModel(3, LFUDAPolicy(depth_penalty=0, tails_first=tails_first))
        fill(model, [100])  # a one-off, the oldest chunk
        fill(model, [1, 2], batch=True)  # a chain; 2 is its put's tail
        fill(model, [200])  # the next put begins: 2 is known to be a tail; one victim
        held[tails_first] = model.held
    assert held[False] == {key(1), key(2), key(200)}  # plain LFU-DA: the oldest goes
    assert held[True] == {key(100), key(1), key(200)}  # the tail goes, not the older one-off


def test_lfuda_put_tail_read_again_is_an_ordinary_chunk() -> None:
    # Read before the next put begins: never marked.
    model = CacheModel(3, LFUDAPolicy(depth_penalty=0))
    fill(model, [100])
    fill(model, [1, 2], batch=True)
    model.get([key(100)])
    model.get([key(1), key(2)])  # the tail was read: the conversation came back to it
    fill(model, [200])  # all read twice: the least recently read, 100, goes
    assert key(2) in model.held and key(100) not in model.held
    # Read after it was marked: unmarked.
    model = CacheModel(4, LFUDAPolicy(depth_penalty=0))
    fill(model, [100])
    fill(model, [1, 2], batch=True)
    fill(model, [300])  # 2 is marked a tail
    for ids in ([300], [100], [1, 2]):
        model.get([key(i) for i in ids])
    fill(model, [200])  # all read twice: the least recently read, 300, goes
    assert key(2) in model.held and key(300) not in model.held


def test_lfuda_single_chunk_puts_are_not_tails() -> None:
    # Chunk-at-a-time clients and promotions: every put has one chunk, none is a tail.
    p = LFUDAPolicy(depth_penalty=0)
    for i in range(4):
        assert p.admit(key(i), 1, None)
        p.inserted(key(i), 1, None)
    assert not any(p.is_tail(k) for k in p._entries)
    assert p.victim(never) == key(0)


def test_lfuda_tail_known_before_it_is_inserted() -> None:
    # The daemon reserves a put's chunks (admit) and inserts them after its copy,
    # which may come after the next put's first admit.
    p = LFUDAPolicy(depth_penalty=0)
    p.admit(key(0), 1, None)
    p.admit(key(1), 1, key(0))
    p.admit(key(2), 1, None)  # next put: 1 is the previous put's tail, not yet inserted
    for i, parent in ((0, None), (1, key(0)), (2, None)):
        p.inserted(key(i), 1, parent)
    assert p.victim(never) == key(1)
    assert [k for k in p._entries if p.is_tail(k)] == [key(1)]


def test_lfuda_age_never_goes_back_and_heap_stays_bounded() -> None:
    rng = random.Random(3)
    p = LFUDAPolicy(min_ghost=64)
    model = CacheModel(32, p)
    ages = []
    for _ in range(3000):
        start = rng.randrange(200)
        fill(model, list(range(start, start + rng.randint(1, 5))), batch=True)
        if rng.random() < 0.5:
            hits = model.lookup([key(start), key(start + 1)])
            model.get([key(start), key(start + 1)][:hits])
        ages.append(p._age)
        assert len(p._heap) <= 2 * p.chunks + 64 and p.chunks == len(model.held) <= 32
        assert len(p._ghost) <= max(64, 8 * p.chunks)
    assert ages == sorted(ages) and ages[-1] > 0


def test_lfuda_age_moves_only_when_the_victim_leaves() -> None:
    # The memory tier may keep a victim it named (the disk declined a lent spill):
    # the cache age must not jump to that chunk's priority, or newcomers would
    # enter above a chunk read four times and it would go before them.
    p = LFUDAPolicy()
    p.inserted(key(1), 1, None)
    for _ in range(4):
        p.touched(key(1))
    assert p.victim(never) == key(1)  # named, then kept
    p.inserted(key(2), 1, None)
    assert p.victim(never) == key(2)  # the one-off goes first
    p.removed(key(2))
    p.inserted(key(3), 1, None)
    assert p.victim(never) == key(3)
    p.removed(key(3))
    assert p.victim(never) == key(1)
    p.removed(key(1))
    p.inserted(key(4), 1, None)  # enters at the age key(1) left: H = 5 + 1
    p.inserted(key(5), 1, None)
    for _ in range(5):
        p.touched(key(5))
    assert p.victim(never) == key(4)


def test_lfuda_beats_lru_on_the_trace_start() -> None:
    require_trace()
    requests = load_trace(DEFAULT_TRACE, 3000)
    capacity = distinct_blocks(requests) // 50  # 2%
    lru, lfuda = (simulate(requests, capacity, p).token_hit_rate for p in ("lru", "lfuda"))
    old = replay_model(requests, CacheModel(capacity, LFUDAPolicy(tails_first=False)), trace_keys(requests))
    assert lfuda > lru and lfuda >= old.token_hit_rate


def test_lfuda_victim_skips_without_losing_candidates() -> None:
    p = LFUDAPolicy()
    for i in range(3):
        p.inserted(key(i), 1, None)
    assert p.victim(lambda k: k == key(0)) == key(1)
    assert p.victim(never) == key(0)  # the skipped key is still a candidate
    assert p.victim(lambda k: True) is None


def test_lfuda_heap_stays_compact() -> None:
    p = LFUDAPolicy()
    for i in range(10):
        p.inserted(key(i), 1, None)
    for _ in range(1000):
        for i in range(10):
            p.touched(key(i))
    assert len(p._heap) <= 2 * p.chunks + 64
    p.touched(key(99))  # unknown keys are ignored
    p.removed(key(99))
    assert p.chunks == 10


def test_memory_tier_keeps_an_empty_policy(closed_at_end: Closer) -> None:
    from lmcache_server.storage import MemoryPool, MemoryTier

    tier = closed_at_end(MemoryTier(MemoryPool(1 << 20, "off"), 0, LFUDAPolicy()))
    assert tier.policy.name == "lfuda"  # an empty policy is not falsy


def test_policy_registry_and_config() -> None:
    assert set(POLICIES) == {"lru", "lfuda", "adaptive"}
    assert make_policy("lru").name == "lru" and make_policy("lfuda").name == "lfuda"
    with pytest.raises(ValueError, match="unknown cache_policy"):
        make_policy("fifo")
    assert ServerConfig().cache_policy == "adaptive"
    assert load_config(environ={}, overrides={"cache_policy": "LRU"}).cache_policy == "lru"
    with pytest.raises(ConfigError, match="cache_policy"):
        load_config(environ={}, overrides={"cache_policy": "belady"})


def test_disk_tier_evicts_by_its_policy(tmp_path: Path, runner: asyncio.Runner, closed_at_end: Closer) -> None:
    async def scenario() -> tuple[set[ChunkKey], set[ChunkKey]]:
        # 4 KiB header + 4 KiB payload = 8 KiB per chunk on disk: 6 fit in 48 KiB.
        out = []
        for policy in (LRUPolicy(), LFUDAPolicy()):
            tier = closed_at_end(DiskTier(tmp_path / policy.name, 48 * 1024, policy=policy))
            await tier.open()
            await tier.put(key(0), b"x" * 4096)
            for i in range(1, 12):
                assert (await tier.get(key(0))) is not None
                await tier.put(key(i), b"x" * 4096)
            out.append(set(tier.keys()))
        return out[0], out[1]

    lru, lfuda = runner.run(scenario())
    assert len(lru) == len(lfuda) == 6
    assert key(0) in lru and key(0) in lfuda  # read before every put: both keep it
    assert {key(i) for i in range(7, 12)} <= lru and {key(i) for i in range(7, 12)} <= lfuda


# -- the offline model ---------------------------------------------------------------------------
def workload(n: int) -> tuple[str, list[Request]]:
    if trace_present():
        return "trace", load_trace(DEFAULT_TRACE, n)
    return "synthetic", synthetic_requests(n)


def plain_lru(requests: list[Request], capacity: int) -> int:
    """Hit tokens of textbook LRU over every block of every request (the README's reference)."""
    from collections import OrderedDict

    cache: OrderedDict[int, None] = OrderedDict()
    total = 0
    for r in requests:
        hits = 0
        for b in r.hash_ids:
            if b not in cache:
                break
            hits += 1
        total += hit_tokens(hits, r.input_length)
        for b in r.hash_ids:
            if b in cache:
                cache.move_to_end(b)
            else:
                cache[b] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return total


@pytest.mark.parametrize("source", ["trace", "synthetic"])
def test_model_with_lru_is_textbook_lru_and_belady_bounds_it(source: str) -> None:
    if source == "trace":
        require_trace()
    requests = load_trace(DEFAULT_TRACE, 2000) if source == "trace" else synthetic_requests(2000)
    capacity = max(64, distinct_blocks(requests) // 20)
    lru = simulate(requests, capacity, "lru")
    assert lru.hit_tokens == plain_lru(requests, capacity)
    best = belady(requests, capacity)
    ours = simulate(requests, capacity, "lfuda")
    assert best.hit_tokens >= ours.hit_tokens and best.hit_tokens >= lru.hit_tokens
    assert lru.hit_blocks <= lru.lookup_blocks == sum(len(r.hash_ids) for r in requests)


# -- the daemon replays, and agrees with the model ------------------------------------------------
def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(lmcache_lookup_\w+_total) (\S+)$", text, re.M)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy", ["adaptive", "lfuda", "lru"])
def test_daemon_replay_matches_model_and_its_metrics_match_ground_truth(daemon_factory, policy: str) -> None:  # type: ignore[no-untyped-def]
    source, requests = workload(1200)
    capacity = max(64, distinct_blocks(requests) // 25)  # 4% (adaptive's head rule is on here on the trace)
    block_bytes = 4096
    daemon = daemon_factory(
        chunk_size=BLOCK_TOKENS, max_local_cpu_size=f"{capacity * block_bytes}B", cache_policy=policy
    )
    # No staged shared-memory puts: their slots hold room for the next put in the pool,
    # which the model does not have (benchmarks/replay_trace.py replays the same way).
    with daemon.client(namespace=NAMESPACE, staged_puts=False) as client:
        counts, _, _, _, statuses = replay(client, requests, block_bytes, progress=lambda line: None)
        stats = client.stats()
    model_policy = make_policy(policy, capacity)  # a tier of `capacity` chunks of size 1
    model = replay_model(requests, CacheModel(capacity, model_policy), trace_keys(requests))
    assert counts.requests == len(requests) and counts.hit_blocks > 0, source
    # Same policy class, same semantics: the daemon's figures are the model's, exactly.
    assert counts.hit_blocks == model.hit_blocks
    assert counts.hit_tokens == model.hit_tokens
    assert abs(counts.token_hit_rate - model.token_hit_rate) <= 0.01
    assert statuses.get("STORED", 0) == model.stored_blocks
    if policy == "adaptive" and source == "trace":
        assert statuses.get("SKIPPED", 0) > 0 and stats["tiers"]["memory"]["skipped"] == statuses["SKIPPED"]
    assert stats["tiers"]["memory"]["evictions"] == model.stored_blocks - stats["tiers"]["memory"]["chunks"]
    # The daemon's own accounting equals the ground truth.
    assert stats["lookup_chunks"] == counts.lookup_blocks
    assert stats["lookup_hit_chunks"] == counts.hit_blocks
    metrics = scrape(daemon.metrics_port)
    assert metrics["lmcache_lookup_chunks_total"] == counts.lookup_blocks
    assert metrics["lmcache_lookup_hit_chunks_total"] == counts.hit_blocks
    assert metrics["lmcache_lookup_hit_tokens_total"] == BLOCK_TOKENS * counts.hit_blocks


@pytest.mark.parametrize("warm", [False, True])
def test_lfuda_inserted_many_is_inserted_one_by_one(warm: bool) -> None:
    """The bulk insert of a restart (disk index from its snapshot) leaves the same
    states, order and victims as one insert per key; with a history to consult
    (``warm``) it takes the one-by-one path itself."""
    rng = random.Random(7)
    bulk, single = LFUDAPolicy(), LFUDAPolicy()
    for p in (bulk, single):  # some life before: touches, removals, a history
        for i in range(50):
            p.inserted(key(i), 1, key(i - 1) if i % 3 else None)
        for i in range(0, 50, 4):
            p.touched(key(i))
        if warm:
            for i in range(40, 50):
                p.removed(key(i))
    keys = [key(1000 + i) for i in range(300)] + ([key(45)] if warm else [])
    rng.shuffle(keys)
    bulk.inserted_many(keys)
    for k in keys:
        single.inserted(k, 1, None)
    assert bulk._entries == single._entries and bulk.order() == single.order()
    assert bulk._clock == single._clock and bulk._last == single._last
    while (v := bulk.victim(never)) is not None:
        assert v == single.victim(never)
        bulk.removed(v)
        single.removed(v)
    assert single.victim(never) is None


def test_lfuda_inserted_many_refuses_a_key_twice() -> None:
    p = LFUDAPolicy()
    with pytest.raises(ValueError):
        p.inserted_many([key(1), key(2), key(1)])
