"""ExtentAllocator invariants under random alloc/free, checked against a shadow model."""

from __future__ import annotations

import random

import pytest

from lmcache_server.storage.memory.allocator import ALIGNMENT, ExtentAllocator, aligned


def check_invariants(a: ExtentAllocator, live: dict[int, int]) -> None:
    # Live extents never overlap and stay inside the pool.
    spans = sorted((off, off + aligned(size)) for off, size in live.items())
    for (_, e1), (s2, _) in zip(spans, spans[1:]):
        assert e1 <= s2
    assert all(s >= 0 and e <= a.capacity for s, e in spans)
    assert a.allocated_bytes == sum(e - s for s, e in spans)
    assert a.free_bytes == a.capacity - a.allocated_bytes
    # Free extents are coalesced: no two free extents touch.
    free = sorted(a._by_start.items())
    for (s1, n1), (s2, _) in zip(free, free[1:]):
        assert s1 + n1 < s2
    assert sum(n for _, n in free) == a.free_bytes


def test_alloc_free_roundtrip() -> None:
    a = ExtentAllocator(16 * ALIGNMENT)
    x = a.alloc(1)
    y = a.alloc(ALIGNMENT + 1)
    assert x == 0 and y == ALIGNMENT
    assert a.allocated_bytes == 3 * ALIGNMENT
    assert a.alloc(14 * ALIGNMENT) is None  # only 13 pages left
    a.free(x)
    a.free(y)
    assert a.free_extents == 1 and a.largest_free == a.capacity and a.fragmentation == 0.0


def test_best_fit_prefers_smallest_hole() -> None:
    a = ExtentAllocator(10 * ALIGNMENT)
    offs = [a.alloc(ALIGNMENT) for _ in range(10)]
    a.free(offs[1])  # 1-page hole
    a.free(offs[4])
    a.free(offs[5])  # 2-page hole
    assert a.alloc(ALIGNMENT) == offs[1]
    assert a.alloc(2 * ALIGNMENT) == offs[4]


def test_pool_smaller_than_a_page_is_refused() -> None:
    with pytest.raises(ValueError):
        ExtentAllocator(ALIGNMENT - 1)


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_keeps_invariants(seed: int) -> None:
    rng = random.Random(seed)
    a = ExtentAllocator(256 * ALIGNMENT)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            a.free(off)
            del live[off]
        else:
            size = rng.randint(1, 12 * ALIGNMENT)
            off = a.alloc(size)
            if off is None:
                assert a.largest_free < aligned(size)
            else:
                live[off] = size
        check_invariants(a, live)
    for off in list(live):
        a.free(off)
    assert a.free_extents == 1 and a.allocated_bytes == 0


@pytest.mark.parametrize("seed", range(3))
def test_untracked_allocator_matches_the_tracked_one(seed: int) -> None:
    """``track_sizes=False`` (the memory tier's: its entries keep the sizes) hands
    out the same offsets as a tracking allocator when given the sizes at free."""
    rng = random.Random(seed)
    tracked, untracked = ExtentAllocator(256 * ALIGNMENT), ExtentAllocator(256 * ALIGNMENT, track_sizes=False)
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            tracked.free(off)
            untracked.free(off, live.pop(off))
        else:
            size = rng.randint(1, 12 * ALIGNMENT)
            off = tracked.alloc(size)
            assert untracked.alloc(size) == off
            if off is not None:
                live[off] = size
        check_invariants(untracked, live)
        assert untracked.allocated_bytes == tracked.allocated_bytes


def test_untracked_allocator_refuses_a_free_it_can_tell_is_wrong() -> None:
    a = ExtentAllocator(8 * ALIGNMENT, track_sizes=False)
    x = a.alloc(ALIGNMENT)
    y = a.alloc(2 * ALIGNMENT)
    assert x is not None and y is not None
    with pytest.raises(TypeError):
        a.free(x)  # no size: it keeps none
    with pytest.raises(TypeError):
        a.size_of(x)
    a.free(y, 2 * ALIGNMENT)
    with pytest.raises(ValueError):
        a.free(y, 2 * ALIGNMENT)  # twice: its start is free
    with pytest.raises(ValueError):
        a.free(x, 2 * ALIGNMENT)  # too long: it would end inside the free extent after it
    assert a.allocated_bytes == ALIGNMENT
    a.free(x, 1)
    assert a.free_extents == 1 and a.allocated_bytes == 0
