"""How much an eviction policy would have to know to reach a hit-rate target on a trace.

Offline measurements on the same model of the memory tier as ``policy_sim.py``
(the daemon's own policy classes, its put/get semantics, its hit counting).
docs/eviction.md ("Why the targets are out of reach") reports the figures.

1. **Admission with a reuse predictor of known quality.** The daemon's ``lru``
   or ``lfuda``, admitting a put's new chunks only while a score says "will be
   read again": ``score = truth + noise`` where truth is 1 if the trace reads the
   chunk again and the noise is one Gaussian draw per put (a predictor judges a
   prompt, not each chunk). The noise sets the predictor's ROC AUC exactly:
   ``AUC = Phi(1 / (sigma * sqrt 2))``. Once a chunk is refused, the rest of
   the put is refused (a later chunk needs its prefix). The threshold is the
   best of a small grid, chosen with hindsight, so each figure is optimistic.
2. **Eviction by predicted next use.** Belady (farthest next use first, a new
   block not admitted when it would be the farthest) on *predicted* next uses:
   ``gap x exp(z)``, one draw ``z ~ N(0, s)`` per request, a never-reused block's
   gap counted as twice the trace. The figure is the quality of the predictor
   as the correlation of log predicted and log true gaps.
3. **What a cache can observe.** Per request (three blocks or more): its turn
   in the conversation (how many earlier requests it extends), its prompt
   blocks, its new blocks, the seconds since the turn it extends, and its
   output length (the engine knows it when the request ends, before any next
   turn). Target: whether the trace reads the request's last full block again,
   and the log gap until it does. Predictor: the mean of the target in the
   request's cell of a grid over these features, fitted *on the trace itself*
   (in-sample, so optimistic). Reported: its AUC and its correlation.

Usage: ``python benchmarks/eviction_bounds.py [--trace PATH] [--capacity-pct 2,5]
[--json OUT]`` (about 2 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import math
import multiprocessing
import random
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from policy_sim import (  # noqa: E402  (benchmarks/ is not a package)
    DEFAULT_TRACE,
    CacheModel,
    Counts,
    access_counts,
    capacities_from,
    distinct_blocks,
    leading_held,
    replay_model,
    trace_keys,
)

from lmcache_server.storage.base import ChunkKey  # noqa: E402
from lmcache_server.storage.policy import LFUDAPolicy, LRUPolicy  # noqa: E402

SIGMAS = (0.0, 0.5, 0.8, 1.2, 2.0)  # AUC 1.0, 0.92, 0.81, 0.72, 0.64
THRESHOLDS = (0.25, 0.5, 0.75, 1.0, 1.5)
LOG_NOISE = (0.0, 1.0, 1.5, 2.0, 3.0, 5.0)


def auc_of_sigma(sigma: float) -> float:
    """ROC AUC of ``label + N(0, sigma)`` for a 0/1 label."""
    return 1.0 if sigma == 0 else 0.5 * (1 + math.erf(1 / (2 * sigma)))


def _with_reuse_predictor(base: type, remaining: dict[ChunkKey, int], sigma: float, threshold: float, seed: int):
    """A policy of class ``base`` that also refuses chunks its noisy reuse predictor rejects."""

    class Predicted(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.rng = random.Random(seed)
            self.noise = 0.0
            self.refusing = False

        def admit(self, key: ChunkKey, size: int, parent: ChunkKey | None) -> bool:
            admitted = super().admit(key, size, parent)
            if parent is None:  # a new put: a new judgement
                self.noise = self.rng.gauss(0.0, sigma) if sigma else 0.0
                self.refusing = False
            remaining[key] -= 1
            truth = 1.0 if remaining[key] > 0 else 0.0
            if self.refusing or truth + self.noise < threshold:
                self.refusing = True
                return False
            return admitted

        def touched(self, key: ChunkKey) -> None:
            remaining[key] -= 1
            super().touched(key)

    return Predicted()


_TRACE: list[Any] = []
_KEYS: dict[int, ChunkKey] = {}


def admission_rate(
    requests: Sequence[Any], keys: dict[int, ChunkKey], base: str, capacity: int, sigma: float, threshold: float
) -> float:
    """Token hit rate of ``base`` ("lru" or "lfuda") behind a reuse predictor of noise ``sigma``."""
    policy_class = {"lru": LRUPolicy, "lfuda": LFUDAPolicy}[base]
    policy = _with_reuse_predictor(policy_class, access_counts(requests, keys), sigma, threshold, seed=1)
    return replay_model(requests, CacheModel(capacity, policy), keys).token_hit_rate


def _admission_cell(cell: tuple[str, int, float, float]) -> tuple[str, int, float, float, float]:
    base, capacity, sigma, threshold = cell
    return base, capacity, sigma, threshold, admission_rate(_TRACE, _KEYS, base, capacity, sigma, threshold)


def admission_bounds(capacities: Sequence[int], processes: int) -> list[dict[str, Any]]:
    cells = [
        (base, cap, sigma, thr)
        for base in ("lru", "lfuda")
        for cap in capacities
        for sigma in SIGMAS
        for thr in ((0.5,) if sigma == 0 else THRESHOLDS)
    ]
    best: dict[tuple[str, int, float], tuple[float, float]] = {}
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        for base, cap, sigma, thr, rate in pool.imap_unordered(_admission_cell, cells):
            if rate > best.get((base, cap, sigma), (-1.0, 0.0))[0]:
                best[(base, cap, sigma)] = (rate, thr)
    return [
        {
            "eviction": base,
            "capacity_blocks": cap,
            "sigma": sigma,
            "auc": round(auc_of_sigma(sigma), 3),
            "best_threshold": best[(base, cap, sigma)][1],
            "token_hit_rate": round(best[(base, cap, sigma)][0], 4),
        }
        for (base, cap, sigma) in sorted(best)
    ]


def next_uses(requests: Sequence[Any]) -> tuple[list[list[int]], int]:
    """Per request, per block: the index of the next request that reads the block (or 2 x the trace)."""
    never = 2 * len(requests)
    later: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in requests]
    for i in range(len(requests) - 1, -1, -1):
        out[i] = [later.get(b, never) for b in requests[i].hash_ids]
        for b in requests[i].hash_ids:
            later[b] = i
    return out, never


def predicted_belady(requests: Sequence[Any], capacity: int, noise: float, seed: int = 1) -> float:
    """Token hit rate of farthest-predicted-next-use eviction with a bypass."""
    nxt, _ = next_uses(requests)
    rng = random.Random(seed)
    held: dict[int, float] = {}
    heap: list[tuple[float, int]] = []
    counts = Counts()
    for i, req in enumerate(requests):
        counts.add_request(req, leading_held(req.hash_ids, held))
        factor = math.exp(rng.gauss(0.0, noise)) if noise else 1.0
        for b, n in zip(req.hash_ids, nxt[i]):
            when = i + (n - i) * factor
            if b not in held and len(held) >= capacity:
                while held.get(heap[0][1]) != -heap[0][0]:
                    heapq.heappop(heap)
                if when >= -heap[0][0]:
                    continue  # farther than everything held: not admitted
                del held[heapq.heappop(heap)[1]]
            held[b] = when
            heapq.heappush(heap, (-when, b))
        if len(heap) > 4 * capacity:
            heap = [(-w, b) for b, w in held.items()]
            heapq.heapify(heap)
    return counts.token_hit_rate


def _belady_cell(cell: tuple[int, float]) -> tuple[int, float, float]:
    capacity, noise = cell
    return capacity, noise, predicted_belady(_TRACE, capacity, noise)


def log_gap_sd(requests: Sequence[Any]) -> float:
    nxt, _ = next_uses(requests)
    logs = [math.log(n - i) for i, row in enumerate(nxt) for n in row if n > i]
    mean = sum(logs) / len(logs)
    return math.sqrt(sum((x - mean) ** 2 for x in logs) / len(logs))


def eviction_bounds(capacities: Sequence[int], processes: int) -> list[dict[str, Any]]:
    sd = log_gap_sd(_TRACE)
    cells = [(cap, s) for cap in capacities for s in LOG_NOISE]
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        results = sorted(pool.imap_unordered(_belady_cell, cells))
    return [
        {
            "capacity_blocks": cap,
            "log_noise": s,
            "correlation": round(sd / math.sqrt(sd * sd + s * s), 3),
            "token_hit_rate": round(rate, 4),
        }
        for cap, s, rate in results
    ]


# -- 3. what the request features predict ------------------------------------------------------------
FEATURE_BINS: dict[str, tuple[float, ...]] = {
    "turn": (0.5, 1.5, 2.5, 3.5, 5.5, 8.5),
    "prompt_blocks": (4, 8, 16, 24, 32, 48, 64),
    "new_blocks": (1, 2, 4, 8, 16, 32),
    "seconds_since_turn": (0, 15, 30, 60, 120, 240, 480),
    "output_tokens": (50, 100, 200, 400, 600, 800),
}
FEATURE_SETS = (
    ("turn",),
    ("prompt_blocks",),
    ("new_blocks",),
    ("seconds_since_turn",),
    ("output_tokens",),
    ("turn", "new_blocks", "seconds_since_turn"),
    ("turn", "prompt_blocks", "new_blocks", "seconds_since_turn", "output_tokens"),
)


def request_features(path: Path) -> list[dict[str, Any]]:
    """One row per request of three blocks or more: features, continued, log next-use gap."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    readers: dict[int, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        for b in row["hash_ids"]:
            readers[b].append(i)
    seen: set[int] = set()
    owner: dict[int, int] = {}  # block -> the latest request that read it
    turn = [0] * len(rows)
    out = []
    for i, row in enumerate(rows):
        ids = row["hash_ids"]
        shared = 0
        while shared < len(ids) and ids[shared] in seen:
            shared += 1
        parent = owner.get(ids[shared - 1], -1) if shared > 1 else -1
        turn[i] = turn[parent] + 1 if parent >= 0 else 0
        if len(ids) >= 3:
            users = readers[ids[-2]]
            at = bisect.bisect_right(users, i)
            gap = users[at] - i if at < len(users) else 2 * len(rows)
            out.append(
                {
                    "turn": turn[i],
                    "prompt_blocks": len(ids),
                    "new_blocks": len(ids) - shared,
                    "seconds_since_turn": (row["timestamp"] - rows[parent]["timestamp"]) / 1000 if parent >= 0 else -1,
                    "output_tokens": row["output_length"],
                    "continued": at < len(users),
                    "log_gap": math.log(gap),
                }
            )
        seen.update(ids)
        for b in ids:
            owner[b] = i
    return out


def _auc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """Mann-Whitney AUC with tied scores sharing their mean rank."""
    order = sorted(range(len(scores)), key=scores.__getitem__)
    ranks = [0.0] * len(scores)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    pos = sum(labels)
    neg = len(labels) - pos
    return (sum(r for r, y in zip(ranks, labels) if y) - pos * (pos + 1) / 2) / (pos * neg)


def _corr(xs: Sequence[float], ys: Sequence[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx and syy else 0.0


def feature_power(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for names in FEATURE_SETS:
        cells = [tuple(bisect.bisect_left(FEATURE_BINS[n], r[n]) for n in names) for r in rows]
        cont: dict[tuple[int, ...], list[float]] = defaultdict(lambda: [0.0, 0.0])
        gaps: dict[tuple[int, ...], list[float]] = defaultdict(lambda: [0.0, 0.0])
        for cell, r in zip(cells, rows):
            cont[cell][0] += r["continued"]
            cont[cell][1] += 1
            gaps[cell][0] += r["log_gap"]
            gaps[cell][1] += 1
        p_cont = [cont[c][0] / cont[c][1] for c in cells]
        p_gap = [gaps[c][0] / gaps[c][1] for c in cells]
        out.append(
            {
                "features": "+".join(names),
                "cells": len(cont),
                "auc_continued": round(_auc(p_cont, [r["continued"] for r in rows]), 3),
                "corr_log_gap": round(_corr(p_gap, [r["log_gap"] for r in rows]), 3),
            }
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    global _TRACE, _KEYS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--capacity-pct", default="2,5", help="capacities, percent of the distinct blocks")
    ap.add_argument("--processes", type=int, default=multiprocessing.cpu_count())
    ap.add_argument("--json", type=Path, help="write every figure here")
    args = ap.parse_args(argv)
    if not args.trace.is_file():
        print(f"eviction_bounds: no trace at {args.trace} (see ../shared/traces/README.md)", file=sys.stderr)
        return 2
    from policy_sim import load_trace

    _TRACE = load_trace(args.trace)
    _KEYS = trace_keys(_TRACE)
    distinct = distinct_blocks(_TRACE)
    capacities = capacities_from([float(p) for p in args.capacity_pct.split(",")], distinct)
    pct = {c: f"{100 * c / distinct:.0f}%" for c in capacities}

    print("1. admission by a reuse predictor of known AUC (best threshold with hindsight), token hit rate", flush=True)
    admission = admission_bounds(capacities, args.processes)
    print(f"{'eviction':>9} {'AUC':>6} " + " ".join(f"{c:>7} ({pct[c]})" for c in capacities))
    for base in ("lru", "lfuda"):
        for sigma in SIGMAS:
            rates = {
                r["capacity_blocks"]: r["token_hit_rate"]
                for r in admission
                if r["eviction"] == base and r["sigma"] == sigma
            }
            print(f"{base:>9} {auc_of_sigma(sigma):6.3f} " + " ".join(f"{rates[c]:>13.4f}" for c in capacities))

    print("\n2. farthest *predicted* next use first, token hit rate by the predictor's log-gap correlation", flush=True)
    eviction = eviction_bounds(capacities, args.processes)
    print(f"{'correlation':>11} " + " ".join(f"{c:>7} ({pct[c]})" for c in capacities))
    for s in LOG_NOISE:
        rates = {r["capacity_blocks"]: r for r in eviction if r["log_noise"] == s}
        print(
            f"{rates[capacities[0]]['correlation']:>11.3f} "
            + " ".join(f"{rates[c]['token_hit_rate']:>13.4f}" for c in capacities)
        )

    print("\n3. what request features predict (fitted on the trace itself: optimistic)", flush=True)
    power = feature_power(request_features(args.trace))
    print(f"{'features':>70} {'cells':>6} {'AUC (continued)':>16} {'corr (log gap)':>15}")
    for r in power:
        print(f"{r['features']:>70} {r['cells']:>6} {r['auc_continued']:>16.3f} {r['corr_log_gap']:>15.3f}")

    if args.json:
        args.json.write_text(
            json.dumps({"admission": admission, "eviction": eviction, "features": power}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
