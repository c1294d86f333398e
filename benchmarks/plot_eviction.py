"""Hit rate vs capacity on the trace for LRU, Belady, lfuda and adaptive: the figure in docs/eviction.md.

Simulates (``policy_sim.py``: the daemon's policy classes, the daemon's
semantics) every policy at capacities from 1% to 50% of the trace's distinct
blocks, prints the table and the worst gap to LRU between 2% and 50%, and
draws ``docs/eviction.png``.  ``--replay-json`` adds the daemon's own replay
points (``replay_trace.py --json``) to the figure.  Needs matplotlib.

Usage: ``python benchmarks/plot_eviction.py [--trace PATH] [--out docs/eviction.png]
[--json rows.json] [--replay-json replay.json]``  (about a minute on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from policy_sim import (  # noqa: E402
    DEFAULT_TRACE,
    REPO,
    capacities_from,
    distinct_blocks,
    load_trace,
    print_table,
    run_grid,
)

from lmcache_server.storage.policy import POLICIES  # noqa: E402

PCTS = [1, 2, 3, 5, 7, 10, 15, 20, 25, 30, 40, 50]
STYLE = {
    "lru": ("LRU", "tab:blue", "o", "-"),
    "adaptive": ("adaptive (ours, the default)", "tab:red", "s", "-"),
    "lfuda": ("lfuda (ours)", "tab:orange", "D", ":"),
    "belady": ("Belady: farthest next use (offline)", "black", "^", "-"),
    "oracle-count": ("oracle: fewest accesses to come (offline)", "tab:gray", "v", "--"),
    "oracle-reuse-lru": ("oracle: LRU admitting only reused blocks (offline)", "tab:green", "d", "--"),
}


def worst_gap_to_lru(rows: Sequence[dict[str, Any]], policy: str, distinct: int) -> tuple[float, int]:
    rate = {(r["policy"], r["capacity_blocks"]): r["token_hit_rate"] for r in rows}
    gaps = [
        (rate[(policy, c)] - rate[("lru", c)], c)
        for (p, c) in rate
        if p == policy and ("lru", c) in rate and 0.02 <= c / distinct <= 0.5 + 1e-9
    ]
    return min(gaps)


def plot(rows: Sequence[dict[str, Any]], replay: Sequence[dict[str, Any]], distinct: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6), dpi=120)
    for policy, (label, color, marker, line) in STYLE.items():
        pts = sorted((r["capacity_blocks"], r["token_hit_rate"]) for r in rows if r["policy"] == policy)
        if pts:
            xs, ys = [100 * c / distinct for c, _ in pts], [h for _, h in pts]
            ax.plot(xs, ys, marker=marker, markersize=4, color=color, linestyle=line, label=label)
    daemon = sorted((r["capacity_blocks"], r["token_hit_rate"]) for r in replay if r.get("source") == "daemon")
    if daemon:
        policies = ", ".join(sorted({r["policy"] for r in replay if r.get("source") == "daemon"}))
        ax.scatter([100 * c / distinct for c, _ in daemon], [h for _, h in daemon], s=110, facecolors="none",
                   edgecolors="black", linewidths=1.5, zorder=5, label=f"{policies}, daemon replay")  # fmt: skip
    targets = [(2, 0.20), (5, 0.30)]  # issue #8's targets for the policy
    ax.scatter([t[0] for t in targets], [t[1] for t in targets], marker="x", s=70, color="tab:red", zorder=6,
               label="target for ours (issue #8)")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xticks(PCTS)
    ax.set_xticklabels([f"{p}%" for p in PCTS])
    ax.set_xlabel(f"memory tier capacity, % of the trace's {distinct:,} distinct 512-token blocks")
    ax.set_ylabel("token hit rate (prefill tokens saved)")
    ax.set_title("Mooncake conversation trace (12,031 requests): hit rate vs capacity")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "eviction.png")
    ap.add_argument("--policies", default="lru,lfuda,adaptive,belady,oracle-count,oracle-reuse-lru")
    ap.add_argument("--json", type=Path, default=None, help="also write the simulated rows here")
    ap.add_argument("--replay-json", type=Path, default=None, help="rows of replay_trace.py to overlay")
    args = ap.parse_args(argv)
    requests = load_trace(args.trace)
    distinct = distinct_blocks(requests)
    rows = run_grid(requests, capacities_from(PCTS, distinct), args.policies.split(","), progress=lambda s: None)
    print_table(rows, distinct)
    for policy in args.policies.split(","):
        if policy in POLICIES and policy != "lru":
            gap, cap = worst_gap_to_lru(rows, policy, distinct)
            print(f"{policy}: worst difference to LRU from 2% to 50%: {gap:+.4f} at {cap} blocks")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    replay = json.loads(args.replay_json.read_text()) if args.replay_json else []
    plot(rows, replay, distinct, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
