"""Fragmentation of the memory tier's allocator under LRU churn.

Drives the real MemoryTier (real pool, real copies) with put streams of
several size mixes and reports, at steady state (after the pool first
fills):

- utilization: payload bytes stored / pool capacity, averaged over puts,
  beside the same figure for a byte-counting LRU (a perfectly compacting
  allocator: the slack left is only what LRU itself leaves);
- fragmentation: 1 - largest free extent / free bytes, averaged over puts;
- extra evictions: evictions beyond what a perfectly compacting allocator
  would need for the same byte stream (the cost of keeping every chunk
  contiguous), as a share of all evictions.

Usage: python benchmarks/bench_allocator.py [--pool-mib 256] [--puts 1000] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
from collections import OrderedDict

from lmcache_server.storage import ChunkKey, MemoryPool, MemoryTier

MiB = 1 << 20

MIXES: dict[str, list[tuple[float, int]]] = {
    # (weight, size in bytes)
    "uniform-16MiB": [(1.0, 16 * MiB)],
    "two-models-14+32MiB": [(0.5, 14 * MiB), (0.5, 32 * MiB)],
    "three-sizes-4/14/32MiB": [(0.4, 4 * MiB), (0.3, 14 * MiB), (0.3, 32 * MiB)],
    "ragged-1..32MiB": [],  # uniform random sizes (worst case, not KV-like)
}


def draw(rng: random.Random, mix: list[tuple[float, int]]) -> int:
    if not mix:
        return rng.randint(1 * MiB, 32 * MiB)
    return rng.choices([s for _, s in mix], weights=[w for w, _ in mix])[0]


def ideal_lru(sizes: list[int], capacity: int) -> tuple[int, float]:
    """Evictions and mean steady-state utilization of an LRU cache that only
    counts bytes (what a perfectly compacting allocator would achieve)."""
    lru: OrderedDict[int, int] = OrderedDict()
    used = evictions = samples = 0
    util = 0.0
    for i, size in enumerate(sizes):
        while used + size > capacity:
            _, victim = lru.popitem(last=False)
            used -= victim
            evictions += 1
        lru[i] = size
        used += size
        if evictions:
            util += used / capacity
            samples += 1
    return evictions, util / max(samples, 1)


async def run_mix(name: str, mix: list[tuple[float, int]], pool_bytes: int, puts: int, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    tier = MemoryTier(MemoryPool(pool_bytes, "off"), max_pinned_bytes=0)
    source = memoryview(os.urandom(32 * MiB))
    sizes = [draw(rng, mix) for _ in range(puts)]
    util = frag = 0.0
    samples = 0
    for i, size in enumerate(sizes):
        await tier.put(ChunkKey("bench", i.to_bytes(32, "little")), source[:size])
        if tier.counters.evictions:  # steady state: the pool has filled once
            util += tier.stored_bytes / tier.allocator.capacity
            frag += tier.allocator.fragmentation
            samples += 1
    ideal, ideal_util = ideal_lru(sizes, tier.allocator.capacity)
    actual = tier.counters.evictions
    await tier.close()
    return {
        "mix": name,
        "pool_bytes": pool_bytes,
        "puts": puts,
        "utilization": round(util / max(samples, 1), 4),
        "ideal_utilization": round(ideal_util, 4),
        "fragmentation": round(frag / max(samples, 1), 4),
        "evictions": actual,
        "ideal_evictions": ideal,
        "extra_eviction_share": round((actual - ideal) / actual, 4) if actual else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool-mib", type=int, default=256)
    parser.add_argument("--puts", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    rows = []
    print(f"{'mix':<26}{'util.':>8}{'ideal':>8}{'fragment.':>11}{'evictions':>11}{'ideal':>8}{'extra':>8}")
    for name, mix in MIXES.items():
        row = asyncio.run(run_mix(name, mix, args.pool_mib * MiB, args.puts, args.seed))
        rows.append(row)
        print(
            f"{name:<26}{row['utilization']:>8.1%}{row['ideal_utilization']:>8.1%}{row['fragmentation']:>11.1%}"
            f"{row['evictions']:>11}{row['ideal_evictions']:>8}{row['extra_eviction_share']:>8.1%}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
