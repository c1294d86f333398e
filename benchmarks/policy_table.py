"""Eviction policies on several traces at once, each against the best classic policy of the same run.

For every trace (the Mooncake conversation trace and the generated ones in
``benchmarks/traces/``, see ``trace_gen.py``) and every capacity (percent of
that trace's distinct blocks), :func:`policy_sim.run_grid` simulates every
policy; the table gives each policy's token hit rate and its ratio to the
best of ``lru``, ``arc`` and ``s3fifo`` at that capacity in the same run
(``base``), and whether ``adaptive`` is at or above it (``goal``).

Usage: ``python benchmarks/policy_table.py [--traces conversation,zipf-prompts,agentic]
[--capacity-pct 2,5,10,20,50] [--limit N] [--json OUT] [--markdown]``
(``--limit``: only the first N requests of each trace, for a quick look).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from policy_sim import DEFAULT_TRACE, capacities_from, distinct_blocks, load_trace, run_grid

TRACES_DIR = Path(__file__).resolve().parent / "traces"
TRACES: dict[str, Path] = {
    "conversation": DEFAULT_TRACE,
    "zipf-prompts": TRACES_DIR / "zipf_prompts.jsonl",
    "agentic": TRACES_DIR / "agentic.jsonl",
}
CLASSIC = ("lru", "arc", "s3fifo")
DEFAULT_POLICIES = (*CLASSIC, "lfuda", "adaptive", "belady")


def trace_path(name: str) -> Path:
    """A trace by its name in :data:`TRACES`, or a path to a JSONL trace."""
    path = TRACES.get(name, Path(name))
    if not path.is_file():
        raise FileNotFoundError(f"trace {name!r}: {path} is not a file (known names: {sorted(TRACES)})")
    return path


def table(
    traces: Sequence[str],
    pcts: Sequence[float],
    policies: Sequence[str] = DEFAULT_POLICIES,
    limit: int | None = None,
    processes: int | None = None,
    progress: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """One row per (trace, capacity): every policy's hit rate, the classic baseline, the ratios."""
    missing = [p for p in CLASSIC if p not in policies]
    if missing:
        raise ValueError(f"the baseline needs {', '.join(CLASSIC)}; missing: {', '.join(missing)}")
    rows: list[dict[str, Any]] = []
    for name in traces:
        requests = load_trace(trace_path(name), limit)
        distinct = distinct_blocks(requests)
        caps = capacities_from(pcts, distinct)
        progress(f"{name}: {len(requests)} requests, {distinct} distinct blocks; capacities {caps}")
        cells = run_grid(requests, caps, policies, processes, progress)
        rate = {(c["policy"], c["capacity_blocks"]): c["token_hit_rate"] for c in cells}
        for pct, cap in zip(pcts, caps):
            rates = {p: rate[(p, cap)] for p in policies}
            base_policy = max(CLASSIC, key=lambda p: rates[p])
            base = rates[base_policy]
            rows.append(
                {
                    "trace": name,
                    "requests": len(requests),
                    "distinct_blocks": distinct,
                    "capacity_pct": pct,
                    "capacity_blocks": cap,
                    "rates": rates,
                    "base": base,
                    "base_policy": base_policy,
                    "ratios": {p: (r / base if base else float("nan")) for p, r in rates.items()},
                    "goal_met": rates["adaptive"] >= base if "adaptive" in rates else None,
                }
            )
    return rows


def format_rows(rows: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    """The table as text: ``rate (ratio to base)`` per policy."""
    if not rows:
        return ""
    policies = list(rows[0]["rates"])
    head = ["trace", "capacity", *policies, "base", "adaptive >= base"]
    lines = []
    for r in rows:
        cells = [f"{r['rates'][p]:.4f} ({r['ratios'][p]:.3f})" for p in policies]
        goal = {True: "yes", False: "no", None: "-"}[r["goal_met"]]
        cap = f"{r['capacity_pct']:g}% ({r['capacity_blocks']})"
        lines.append([r["trace"], cap, *cells, f"{r['base']:.4f} {r['base_policy']}", goal])
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(line) + " |" for line in lines]
        return "\n".join(out)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    return "\n".join("  ".join(f"{x:>{w}}" for x, w in zip(line, widths)) for line in [head, *lines])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default=",".join(TRACES), help=f"names ({', '.join(TRACES)}) or JSONL paths")
    ap.add_argument("--capacity-pct", default="2,5,10,20,50")
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests of each trace")
    ap.add_argument("--processes", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be at least 1")
    started = time.perf_counter()
    rows = table(
        args.traces.split(","),
        [float(x) for x in args.capacity_pct.split(",")],
        args.policies.split(","),
        args.limit,
        args.processes,
        lambda s: print(s, flush=True),
    )
    print(f"{len(rows)} rows in {time.perf_counter() - started:.1f}s; ratios against the best of {'/'.join(CLASSIC)}")
    print(format_rows(rows, args.markdown))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
