"""Offline simulation of the memory tier on a prefix-block trace, with the daemon's own policies.

The model mirrors what the daemon does for one replayed request (see
``replay_trace.py``), with every chunk the same size so capacity is a count of
chunks:

1. ``lookup`` of the request's block keys: the leading keys held, touching
   nothing (the daemon peeks);
2. ``get`` of those leading hits: each is a touch (``policy.touched``);
3. one ``put`` of the remaining keys, in prefix order: a key already held is
   a touch (the put answers EXISTS); a new one is offered to ``policy.admit``
   with its parent (the previous key of the same put, None for the first),
   evicts ``policy.victim`` chunks until it fits, and is ``policy.inserted``.

This is :class:`lmcache_server.storage.memory.MemoryTier`'s put/get logic for
uniform chunks (allocation first, eviction only when the pool is full), and
the policy objects are the daemon's own classes from
:mod:`lmcache_server.storage.policy`, so the daemon's replay must match the
simulation of the same policy (``tests/storage/policy/test_policy.py`` checks it exactly).

``belady`` (farthest next use, offline only) evicts the held key whose next
access in the trace is farthest away; like the reference figures in the trace's
README it always admits.  Two more offline bounds show what an online policy
could at best learn: ``oracle-reuse-lru`` (LRU that admits only blocks the
trace will access again) and ``oracle-count`` (evicts the block with the
fewest accesses still to come: perfect frequency, no timing).  Hits are counted as in the README: a request's hit is
its leading held blocks, in tokens ``min(512 * hits, input_length - 1)`` (the
last token is always computed, a partial last block counts its real length).

Keys: block id ``i`` becomes the 32-byte chunk digest
``sha256(b"lmcache-trace-block\\0" + i.to_bytes(8, "big"))`` (:func:`block_digest`).
A trace id already names its whole prefix, so no hash chain is needed.

``arc`` and ``s3fifo`` are published baselines (simulated only, :mod:`sim_policies`,
which also holds the oracles).  ``lfuda-no-tails`` is the ``lfuda`` policy without its put-tails rule (an
ablation, simulated only).

Usage: ``python benchmarks/policy_sim.py [--trace PATH] [--capacity-pct 2,5,10,20,50]
[--policies lru,lfuda,belady] [--json OUT]``
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Container, Sequence
from pathlib import Path
from typing import Any

from sim_policies import BASELINES, ORACLES
from sim_trace import (  # noqa: F401 (the trace helpers are imported from here too)
    BLOCK_TOKENS,
    Request,
    block_digest,
    distinct_blocks,
    hit_tokens,
    load_trace,
    synthetic_requests,
)

from lmcache_server.storage.base import ChunkKey
from lmcache_server.storage.memory.allocator import ALIGNMENT as PAGE_BYTES
from lmcache_server.storage.policy import POLICIES, EvictionPolicy, LFUDAPolicy, make_policy

NAMESPACE = "mooncake-trace|bfloat16|L28|KV4|D128|tp0of1|c512"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
OFFLINE_ONLY = ("belady", "oracle-reuse-lru", "oracle-count")
# Ablations of the daemon's policies, simulated only (figures in docs/eviction.md).
VARIANTS: dict[str, Callable[[], EvictionPolicy]] = {
    "lfuda-no-tails": lambda: LFUDAPolicy(tails_first=False),  # lfuda before put tails went first
}


@dataclasses.dataclass
class Counts:
    """Ground truth of a replay (daemon or model)."""

    requests: int = 0
    total_tokens: int = 0
    hit_tokens: int = 0
    lookup_blocks: int = 0
    hit_blocks: int = 0
    put_blocks: int = 0
    stored_blocks: int = 0

    def add_request(self, req: Request, hits: int) -> None:
        self.requests += 1
        self.total_tokens += req.input_length
        self.hit_tokens += hit_tokens(hits, req.input_length)
        self.lookup_blocks += len(req.hash_ids)
        self.hit_blocks += hits

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0


class CacheModel:
    """The memory tier: ``capacity`` chunks of one size, the given policy.

    With ``size_of`` (a chunk's bytes, e.g. its encoded size under a KV codec:
    benchmarks/trace_codec.py) ``capacity`` is bytes and chunks take their own
    sizes, rounded up to the pool's 4 KiB pages as the daemon's allocator does."""

    def __init__(self, capacity: int, policy: EvictionPolicy, size_of: Callable[[ChunkKey], int] | None = None):
        if capacity < 1:
            raise ValueError("capacity must be at least one chunk")
        self.capacity = capacity
        self.policy = policy
        self.held: set[ChunkKey] = set()
        self.evictions = 0
        self.size_of = size_of
        self.used = 0
        self._sizes: dict[ChunkKey, int] = {}

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        held = self.held
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def get(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            if key in self.held:
                self.policy.touched(key)

    def put(self, keys: Sequence[ChunkKey]) -> int:
        """Stored count; parents are the previous key of this put, as the tiered store passes them.

        Like the daemon (TieredStore.prepare_puts), a put first reserves room for
        all its new chunks, evicting as needed, and only then inserts them, so a
        put never evicts its own chunks.
        """
        if self.size_of is not None:
            return self._put_sized(keys)
        policy, held = self.policy, self.held
        parent: ChunkKey | None = None
        new: list[tuple[ChunkKey, ChunkKey | None]] = []
        reserved: set[ChunkKey] = set()
        for key in keys:
            if key in held:
                policy.touched(key)
            elif key in reserved:
                pass  # repeated within the put: EXISTS
            elif policy.admit(key, 1, parent):
                if len(held) + len(new) >= self.capacity:
                    victim = policy.victim(_never)
                    if victim is None:  # nothing evictable: NO_SPACE
                        parent = key
                        continue
                    held.remove(victim)
                    policy.removed(victim)
                    self.evictions += 1
                new.append((key, parent))
                reserved.add(key)
            parent = key
        for key, key_parent in new:
            held.add(key)
            policy.inserted(key, 1, key_parent)
        return len(new)

    def _put_sized(self, keys: Sequence[ChunkKey]) -> int:
        """:meth:`put` for chunks of their own sizes (bytes, page-rounded)."""
        assert self.size_of is not None
        policy, held, sizes = self.policy, self.held, self._sizes
        parent: ChunkKey | None = None
        new: list[tuple[ChunkKey, ChunkKey | None, int]] = []
        reserved: dict[ChunkKey, int] = {}
        pending = 0
        for key in keys:
            if key in held:
                policy.touched(key)
            elif key in reserved:
                pass
            else:
                size = -(-self.size_of(key) // PAGE_BYTES) * PAGE_BYTES
                if size <= self.capacity and policy.admit(key, size, parent):
                    fits = True
                    while self.used + pending + size > self.capacity:
                        victim = policy.victim(_never)
                        if victim is None:
                            fits = False
                            break
                        held.remove(victim)
                        policy.removed(victim)
                        self.used -= sizes.pop(victim)
                        self.evictions += 1
                    if fits:
                        new.append((key, parent, size))
                        reserved[key] = size
                        pending += size
            parent = key
        for key, key_parent, size in new:
            held.add(key)
            sizes[key] = size
            self.used += size
            policy.inserted(key, size, key_parent)
        return len(new)


def _never(key: ChunkKey) -> bool:
    return False


def trace_keys(requests: Sequence[Request]) -> dict[int, ChunkKey]:
    ids = {b for r in requests for b in r.hash_ids}
    return {i: ChunkKey(NAMESPACE, block_digest(i)) for i in ids}


def replay_model(requests: Sequence[Request], model: CacheModel, keys: dict[int, ChunkKey]) -> Counts:
    counts = Counts()
    for req in requests:
        ks = [keys[b] for b in req.hash_ids]
        hits = model.lookup(ks)
        model.get(ks[:hits])
        counts.put_blocks += len(ks) - hits
        counts.stored_blocks += model.put(ks[hits:])
        counts.add_request(req, hits)
    return counts


def leading_held(ids: Sequence[int], held: Container[int]) -> int:
    """How many leading block ids are held (a request's hit blocks)."""
    hits = 0
    for b in ids:
        if b not in held:
            break
        hits += 1
    return hits


def belady(requests: Sequence[Request], capacity: int) -> Counts:
    """Farthest next use, same request sequence and hit counting, always admitting."""
    flat = [b for r in requests for b in r.hash_ids]
    never = len(flat) + 1
    next_use = [never] * len(flat)
    seen: dict[int, int] = {}
    for pos in range(len(flat) - 1, -1, -1):
        next_use[pos] = seen.get(flat[pos], never)
        seen[flat[pos]] = pos
    held: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block), lazy
    counts = Counts()
    pos = 0
    for req in requests:
        counts.add_request(req, leading_held(req.hash_ids, held))
        for b in req.hash_ids:  # every block is accessed once: hits by get, the rest by put
            nxt = next_use[pos]
            pos += 1
            if b not in held and len(held) >= capacity:
                while True:
                    neg, victim = heapq.heappop(heap)
                    if held.get(victim) == -neg:
                        break
                del held[victim]
            held[b] = nxt
            heapq.heappush(heap, (-nxt, b))
    return counts


def access_counts(requests: Sequence[Request], keys: dict[int, ChunkKey]) -> dict[ChunkKey, int]:
    counts: dict[ChunkKey, int] = dict.fromkeys(keys.values(), 0)
    for r in requests:
        for b in r.hash_ids:
            counts[keys[b]] += 1
    return counts


KNOWN = {*POLICIES, *BASELINES, *OFFLINE_ONLY, *VARIANTS}
"""Every policy name :func:`simulate` runs."""


# -- a grid of runs, in parallel -------------------------------------------------------------------
_TRACE: list[Request] = []
_KEYS: dict[int, ChunkKey] = {}


def simulate(
    requests: Sequence[Request], capacity: int, policy: str, keys: dict[int, ChunkKey] | None = None
) -> Counts:
    if policy == "belady":
        return belady(requests, capacity)
    keys = keys or trace_keys(requests)
    if policy in ORACLES:
        return replay_model(requests, CacheModel(capacity, ORACLES[policy](access_counts(requests, keys))), keys)
    # Chunks of one size: a tier of ``capacity`` chunks of size 1 (what ``adaptive`` models).
    if policy in BASELINES:
        made = BASELINES[policy](capacity)
    else:
        made = make_policy(policy, capacity) if policy in POLICIES else VARIANTS[policy]()
    return replay_model(requests, CacheModel(capacity, made), keys)


def _run_cell(cell: tuple[str, int]) -> tuple[str, int, Counts, float]:
    policy, capacity = cell
    started = time.perf_counter()
    counts = simulate(_TRACE, capacity, policy, _KEYS)
    return policy, capacity, counts, time.perf_counter() - started


def sim_row(policy: str, capacity: int, counts: Counts) -> dict[str, Any]:
    return {
        "policy": policy,
        "capacity_blocks": capacity,
        "token_hit_rate": round(counts.token_hit_rate, 6),
        "source": "sim",
        "hit_tokens": counts.hit_tokens,
        "total_tokens": counts.total_tokens,
        "hit_blocks": counts.hit_blocks,
        "lookup_blocks": counts.lookup_blocks,
        "requests": counts.requests,
    }


def run_grid(
    requests: list[Request],
    capacities: Sequence[int],
    policies: Sequence[str],
    processes: int | None = None,
    progress: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Simulate every (policy, capacity); one row each, in (policy, capacity) order."""
    global _TRACE, _KEYS
    _TRACE, _KEYS = requests, trace_keys(requests)
    cells = [(p, c) for p in policies for c in capacities]
    for p in policies:
        if p not in KNOWN:
            raise ValueError(f"unknown policy {p!r}; known: {sorted(KNOWN)}")
    results: dict[tuple[str, int], Counts] = {}
    processes = processes or os.cpu_count() or 1
    if processes > 1 and len(cells) > 1:
        with multiprocessing.get_context("fork").Pool(min(processes, len(cells))) as pool:
            for policy, capacity, counts, secs in pool.imap_unordered(_run_cell, cells):
                results[(policy, capacity)] = counts
                progress(f"sim {policy:>16} {capacity:>7} blocks: {counts.token_hit_rate:.4f} ({secs:.1f}s)")
    else:
        for cell in cells:
            policy, capacity, counts, secs = _run_cell(cell)
            results[cell] = counts
            progress(f"sim {policy:>16} {capacity:>7} blocks: {counts.token_hit_rate:.4f} ({secs:.1f}s)")
    return [sim_row(p, c, results[(p, c)]) for p, c in cells]


def capacities_from(pcts: Sequence[float], distinct: int) -> list[int]:
    return [max(1, int(distinct * p / 100)) for p in pcts]


def print_table(rows: Sequence[dict[str, Any]], distinct: int) -> None:
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    caps = sorted({r["capacity_blocks"] for r in rows})
    rate = {(r["policy"], r["capacity_blocks"]): r["token_hit_rate"] for r in rows}
    width = {p: max(8, len(p)) for p in policies}
    print(f"{'capacity (blocks)':>22} " + " ".join(f"{p:>{width[p]}}" for p in policies))
    for c in caps:
        cells = " ".join(f"{rate[(p, c)]:{width[p]}.4f}" if (p, c) in rate else " " * width[p] for p in policies)
        print(f"{c:>9} ({100 * c / distinct:5.1f}%)     {cells}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--capacity-pct", default="2,5,10,20,50", help="capacities, percent of the distinct blocks")
    ap.add_argument("--capacity-blocks", default="", help="capacities in blocks (instead of --capacity-pct)")
    ap.add_argument("--policies", default="lru,lfuda,belady")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--processes", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    requests = load_trace(args.trace, args.limit)
    distinct = distinct_blocks(requests)
    if args.capacity_blocks:
        caps = [int(x) for x in args.capacity_blocks.split(",")]
    else:
        caps = capacities_from([float(x) for x in args.capacity_pct.split(",")], distinct)
    print(f"{len(requests)} requests, {distinct} distinct blocks; capacities {caps}", flush=True)
    started = time.perf_counter()
    rows = run_grid(requests, caps, args.policies.split(","), args.processes, lambda s: print(s, flush=True))
    print(f"simulated {len(rows)} runs in {time.perf_counter() - started:.1f}s")
    print_table(rows, distinct)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
