"""The adaptive policy: lfuda plus a head-only admission rule, on while its expert is ahead."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from lmcache_server.storage.base import ChunkKey
from lmcache_server.storage.policy import LFUDAPolicy, make_policy
from lmcache_server.storage.policy.adaptive import AdaptivePolicy

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

from policy_sim import (  # noqa: E402
    DEFAULT_TRACE,
    CacheModel,
    distinct_blocks,
    load_trace,
    replay_model,
    simulate,
    synthetic_requests,
    trace_keys,
)

from ._traces import trace_present  # noqa: E402

AGENTIC = Path(__file__).resolve().parents[3] / "benchmarks" / "traces" / "agentic.jsonl"


def key(i: int) -> ChunkKey:
    return ChunkKey("ns", i.to_bytes(32, "big"))


def test_without_a_capacity_it_is_lfuda() -> None:
    assert type(make_policy("adaptive")) is LFUDAPolicy  # the disk tier's instance: it sees no puts
    p = make_policy("adaptive", 4096 * 100, 4096)
    assert isinstance(p, AdaptivePolicy) and p.capacity_chunks() is None
    assert p.admit(key(1), 5000, None)
    assert p.capacity_chunks() == 50  # 8 KiB per chunk as allocated: 400 KiB hold 50


def test_head_rule_refuses_a_first_seen_puts_tail_only() -> None:
    p = AdaptivePolicy(capacity_bytes=1000)
    p.head_rule = True  # as if its expert were ahead (and stays so for this check)
    p._heads.hits = 1e9
    first = [key(i) for i in range(1, 5)]
    assert [p.admit(k, 1, parent) for k, parent in zip(first, [None, *first])] == [True, False, False, False]
    p.inserted(first[0], 1, None)
    again = [first[0], key(9)]  # a put led by a chunk it holds: not first seen, all admitted
    assert [p.admit(k, 1, parent) for k, parent in zip(again, [None, again[0]])] == [True, True]
    # The next turn of the first prompt: its put starts at a chunk refused before, so the
    # prompt is not new, and all of it is stored now.
    turn = [first[1], first[2], key(30)]
    assert [p.admit(k, 1, parent) for k, parent in zip(turn, [None, *turn])] == [True, True, True]
    p._heads.hits = 0.0
    fresh = [key(20), key(21)]
    assert [p.admit(k, 1, parent) for k, parent in zip(fresh, [None, fresh[0]])] == [True, True]
    assert p.head_rule is False  # the all-admitting expert caught up: the rule is off again


def _replay(requests: list[Any], capacity: int, policy: Any) -> float:
    return replay_model(requests, CacheModel(capacity, policy), trace_keys(requests)).token_hit_rate


def test_rule_follows_the_experts_and_the_order_is_lfudas() -> None:
    requests = synthetic_requests(1500)
    capacity = max(64, distinct_blocks(requests) // 100)
    p = AdaptivePolicy(capacity)
    seen_rule = []
    original = p._play

    def watched(*args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        # The head rule: its expert ahead of lfuda's; recency: the LRU expert strictly ahead of
        # both, on the counts that decay four times slower.
        assert p.head_rule == (p._heads.hits > p._all.hits)
        assert p.recency_order == (p._recency.slow > max(p._all.slow, p._heads.slow))
        seen_rule.append(p.head_rule)

    p._play = watched  # type: ignore[method-assign]
    _replay(requests, capacity, p)
    assert True in seen_rule and False in seen_rule and p.switches >= 2
    # A cache big enough: the head rule never pays, and it is lfuda to the token
    # (here the recency expert leads once, late, and changes no hit).
    big = distinct_blocks(requests) // 4
    q = AdaptivePolicy(big)
    assert _replay(requests, big, q) == simulate(requests, big, "lfuda").token_hit_rate and not q.head_rule
    # Never full: no expert ever leads, no switch.
    everything = distinct_blocks(requests)
    r = AdaptivePolicy(everything)
    assert _replay(requests, everything, r) == simulate(requests, everything, "lfuda").token_hit_rate
    assert r.switches == 0


def test_recency_order_evicts_least_recently_used_skipping_the_skipped() -> None:
    p = AdaptivePolicy(capacity_bytes=100)
    for i in range(1, 6):
        assert p.admit(key(i), 1, None)
        p.inserted(key(i), 1, None)
    for _ in range(3):  # key 1 is the most frequent: lfuda's victim is another one
        p.touched(key(1))
    p.touched(key(2))  # recency now: 3, 4, 5, 1, 2
    p.recency_order = True
    assert p.victim(lambda k: False) == key(3)
    assert p.victim(lambda k: k == key(3)) == key(4)
    p.removed(key(3))
    assert p.victim(lambda k: False) == key(4) and key(3) not in p.order()
    p.recency_order = False
    assert p.victim(lambda k: False) in {key(2), key(4), key(5)}  # lfuda again: never the hot key 1


def test_on_an_agentic_trace_it_follows_the_recency_expert() -> None:
    """benchmarks/traces/agentic.jsonl (deep chains, sessions that end): at 10% of its
    distinct blocks LRU beats lfuda; adaptive turns recency on and is at LRU's level."""
    requests = load_trace(AGENTIC)
    capacity = distinct_blocks(requests) // 10
    lru = simulate(requests, capacity, "lru").token_hit_rate
    lfuda = simulate(requests, capacity, "lfuda").token_hit_rate
    p = AdaptivePolicy(capacity)
    adaptive = _replay(requests, capacity, p)
    assert lru > lfuda + 0.005  # the shape this test is about
    assert p.recency_switches > 0 and adaptive >= lru - 0.003
    assert p.stats()["recency_order_switches"] == p.recency_switches


def test_on_the_trace_start_it_wins_small_and_never_loses_large() -> None:
    on_trace = trace_present()
    requests = load_trace(DEFAULT_TRACE, 3000) if on_trace else synthetic_requests(3000)
    distinct = distinct_blocks(requests)
    small, large = distinct // 50, distinct // 4
    lfuda_small = simulate(requests, small, "lfuda").token_hit_rate
    adaptive_small = simulate(requests, small, "adaptive").token_hit_rate
    if on_trace:
        assert adaptive_small > lfuda_small + 0.003  # 2% of the slice: the head rule pays
    else:
        assert adaptive_small >= lfuda_small - 0.005  # synthetic: never much worse
    # 25%: the head rule does not pay; where LRU's order leads, the recency expert takes it.
    assert simulate(requests, large, "adaptive").token_hit_rate >= simulate(requests, large, "lfuda").token_hit_rate


def test_in_an_event_loop_the_experts_play_after_the_callback_in_order() -> None:
    """In the daemon the experts see each access after the request that made it
    (call_soon), in order: the same hits and switches as played at once."""
    import asyncio

    requests = synthetic_requests(600)
    capacity = max(64, distinct_blocks(requests) // 100)
    calls: list[tuple[str, ChunkKey, ChunkKey | None]] = []
    recorder = AdaptivePolicy(capacity)
    for name in ("admit", "inserted", "touched"):
        method = getattr(recorder, name)

        def recording(*args: Any, _name: str = name, _method: Any = method) -> Any:
            calls.append((_name, args[0], args[2] if len(args) > 2 else None))
            return _method(*args)

        setattr(recorder, name, recording)
    _replay(requests, capacity, recorder)  # no loop: each access played at once

    def feed(p: AdaptivePolicy, start: int, stop: int) -> None:
        for name, k, parent in calls[start:stop]:
            if name == "touched":
                p.touched(k)
            else:
                getattr(p, name)(k, 1, parent)

    at_once = AdaptivePolicy(capacity)
    for i in range(0, len(calls), 50):
        feed(at_once, i, i + 50)

    async def in_loop() -> AdaptivePolicy:
        p = AdaptivePolicy(capacity)
        for i in range(0, len(calls), 50):  # a request's worth of calls per callback
            feed(p, i, i + 50)
            assert p._plays  # nothing played yet: the request's callback has not ended
            await asyncio.sleep(0)
            assert not p._plays
        return p

    deferred = asyncio.run(in_loop())
    assert (deferred._all.hits, deferred._heads.hits) == (at_once._all.hits, at_once._heads.hits)
    assert deferred.switches == at_once.switches > 0
    assert deferred._all.order.order() == at_once._all.order.order()


def test_the_recency_list_is_an_lru_order_of_the_slots() -> None:
    """The tier's recency order (8 bytes a chunk) against an OrderedDict, on random operations."""
    import random
    from collections import OrderedDict

    from lmcache_server.storage.policy.adaptive import _SlotList

    rng = random.Random(4)
    fast, truth = _SlotList(), OrderedDict[int, None]()
    for _ in range(5000):
        slot = rng.randrange(300)
        op = rng.random()
        if slot in truth and op < 0.4:
            fast.unlink(slot)
            del truth[slot]
        elif slot in truth:
            fast.to_end(slot)
            truth.move_to_end(slot)
        else:
            fast.link(slot)
            truth[slot] = None
        if rng.random() < 0.1:  # a full compare now and then
            assert list(fast) == list(truth)
    assert list(fast) == list(truth)
