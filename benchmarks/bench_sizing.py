"""The per-access cost of the sizing telemetry (lmcache_server/storage/sizing.py).

Times :meth:`SizingWindow.record` on batches of fresh 32-byte digests (a
lookup's or get's keys, as msgpack hands them over: new bytes objects whose
hash is not cached yet) against a baseline measured in the same run on the
same kind of batches: inserting each key into a dict (one hash and a table
store, the least any per-key bookkeeping costs).  Prints ns per access for
both and their ratio, and the sketch's estimate against the true distinct count.
Then what it adds to a whole lookup: the real store's ``lookup_now`` (memory
tier only, half the keys stored) with the telemetry off and on, alternated.

Usage: python benchmarks/bench_sizing.py [--batch 64] [--accesses 400000] [--keys 50000] [--window 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from lmcache_server.storage import ChunkKey, MemoryPool, MemoryTier, TieredStore
from lmcache_server.storage.sizing import Sizing, SizingWindow


def batches(rng: random.Random, accesses: int, keys: int, batch: int) -> list[list[bytes]]:
    """``accesses`` digests drawn from ``keys`` distinct ones, each a fresh bytes object."""
    pool = [rng.randbytes(32) for _ in range(keys)]
    # bytes(bytearray(d)) copies: a new object with no cached hash, like a decoded key.
    draws = [bytes(bytearray(pool[rng.randrange(keys)])) for _ in range(accesses)]
    return [draws[i : i + batch] for i in range(0, accesses, batch)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64, help="keys per record() call (a lookup's key list)")
    ap.add_argument("--accesses", type=int, default=400_000)
    ap.add_argument("--keys", type=int, default=50_000, help="distinct keys the accesses are drawn from")
    ap.add_argument("--window", type=int, default=100_000, help="window_chunks")
    ap.add_argument("--repeats", type=int, default=5, help="best of this many runs")
    args = ap.parse_args()
    rng = random.Random(1)

    best_dict = best_sketch = float("inf")
    for _ in range(args.repeats):
        work = batches(rng, args.accesses, args.keys, args.batch)
        seen: dict[bytes, bool] = {}
        t0 = time.perf_counter_ns()
        for keys in work:
            for d in keys:
                seen[d] = True
        best_dict = min(best_dict, (time.perf_counter_ns() - t0) / args.accesses)

        work = batches(rng, args.accesses, args.keys, args.batch)
        hits = [[False] * len(b) for b in work]
        window = SizingWindow(args.window)
        t0 = time.perf_counter_ns()
        for keys, flags in zip(work, hits):
            window.record("ns", keys, flags)
        best_sketch = min(best_sketch, (time.perf_counter_ns() - t0) / args.accesses)

    # Accuracy on the last window: the true distinct count of the accesses it covers.
    flat = [d for b in work for d in b]
    covered = window.stats()["accesses"]
    true_distinct = len(set(flat[len(flat) - int(covered) :]))
    est = window.stats()["distinct"]
    print(f"accesses {args.accesses}, batches of {args.batch}, {args.keys} keys, window {args.window}")
    print(f"dict insert (baseline): {best_dict:7.1f} ns/access")
    print(f"SizingWindow.record:    {best_sketch:7.1f} ns/access   ({best_sketch / best_dict:.2f}x the baseline)")
    print(
        f"distinct in the window: true {true_distinct}, estimated {est:.0f} "
        f"({(est - true_distinct) / true_distinct:+.2%}); ceiling {window.stats()['ceiling']:.4f} "
        f"vs true {(covered - true_distinct) / covered:.4f}"
    )

    off, on = asyncio.run(lookup_cost(rng, args.batch, args.repeats))
    print(f"lookup_now of {args.batch} keys: {off:7.1f} ns/key off, {on:7.1f} ns/key on ({on / off:.2f}x)")


async def lookup_cost(rng: random.Random, batch: int, repeats: int) -> tuple[float, float]:
    """ns per key of ``TieredStore.lookup_now`` without and with the telemetry."""
    memory = MemoryTier(MemoryPool(64 << 20, "off"), max_pinned_bytes=0)
    stores = {False: TieredStore(memory), True: TieredStore(memory, sizing=Sizing(1 << 20))}  # one memory, two stores
    digests = [rng.randbytes(32) for _ in range(4096)]
    for d in digests[::2]:
        await memory.put(ChunkKey("ns", d), b"x" * 4096)
    lookups = [digests[i : i + batch] for i in range(0, len(digests), batch)] * 10
    best = {False: float("inf"), True: float("inf")}
    for _ in range(repeats):
        for sizing, store in stores.items():
            t0 = time.perf_counter_ns()
            for keys in lookups:
                store.lookup_now("ns", keys)
            best[sizing] = min(best[sizing], (time.perf_counter_ns() - t0) / (len(lookups) * batch))
    await stores[False].close()
    return best[False], best[True]


if __name__ == "__main__":
    main()
