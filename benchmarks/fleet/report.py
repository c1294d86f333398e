"""Figures per configuration, the table, the ratios, and the TTFT CDF as an SVG (by hand,
as deploy/grafana/preview.py draws: no matplotlib in the main venv).

:func:`figures` turns a :class:`~.measure.ConfigResult` into one row: TTFT p50/p90/p99,
end-to-end p50/p99, requests/s and prompt tokens/s completed (over the replay's wall
time), the share of prompt tokens per source (vLLM's counters; our connector's for
``lmcache-server``), and the service's CPU seconds per request and per GiB served.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

from benchmarks._harness import percentile

from .measure import ConfigResult
from .trace import Workload

GIB = 1024**3
VLLM_SHORT = {"local_compute": "compute", "local_cache_hit": "local", "external_kv_transfer": "external"}
COLOURS = ("#73bf69", "#f2cc0c", "#5794f2", "#ff780a", "#b877d9", "#f2495c")


def figures(result: ConfigResult, workload: Workload) -> dict[str, Any]:
    done = [o for o in result.outcomes if o.ok]
    ttft = [o.ttft_s for o in done if o.ttft_s is not None]
    e2e = [o.e2e_s for o in done if o.e2e_s is not None]
    prompt_tokens = sum(len(workload.requests[o.index].prompt) for o in done)
    sources_total = sum(result.vllm_sources.values())
    row: dict[str, Any] = {
        "configuration": result.name,
        "replicas": result.replicas,
        "router": result.router,
        "answered": len(done),
        "requests": len(workload.requests),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "requests_per_s": len(done) / result.wall_s if result.wall_s else 0.0,
        "prompt_tokens_per_s": prompt_tokens / result.wall_s if result.wall_s else 0.0,
        "vllm_shares": {k: v / sources_total for k, v in result.vllm_sources.items()} if sources_total else {},
        "connector_shares": {},
        "decode_p50_s": percentile(
            [o.e2e_s - o.ttft_s for o in done if o.e2e_s is not None and o.ttft_s is not None], 50
        ),
        "preemptions": result.preemptions,
        "service_cpu_s_per_request": None,
        "service_cpu_s_per_gib_served": None,
    }
    connector_total = sum(result.connector_sources.values())
    if connector_total:
        row["connector_shares"] = {k: v / connector_total for k, v in result.connector_sources.items()}
    if result.service_cpu_s is not None and done:
        row["service_cpu_s_per_request"] = result.service_cpu_s / len(done)
        sent = result.service_bytes.get("sent")
        if sent:
            row["service_cpu_s_per_gib_served"] = result.service_cpu_s / (sent / GIB)
    return row


def _shares(shares: dict[str, float], short: dict[str, str] | None = None) -> str:
    return " ".join(f"{(short or {}).get(k, k)} {v:.0%}" for k, v in sorted(shares.items()) if v) or "-"


def table(rows: Sequence[dict[str, Any]], errors: Sequence[ConfigResult] = ()) -> str:
    header = (
        f"{'configuration':<15} {'n':>2} {'router':<11} {'ok':>7} {'TTFT p50':>9} {'p90':>7} {'p99':>7} "
        f"{'E2E p50':>8} {'p99':>7} {'req/s':>6} {'prompt tok/s':>12}  prompt tokens by source (vLLM)"
    )
    lines = [header]
    for r in rows:
        lines.append(
            f"{r['configuration']:<15} {r['replicas']:>2} {r['router']:<11} {r['answered']:>3}/{r['requests']:<3} "
            f"{r['ttft_p50_s']:>8.3f}s {r['ttft_p90_s']:>6.2f}s {r['ttft_p99_s']:>6.2f}s "
            f"{r['e2e_p50_s']:>7.2f}s {r['e2e_p99_s']:>6.2f}s {r['requests_per_s']:>6.2f} "
            f"{r['prompt_tokens_per_s']:>12.0f}  {_shares(r['vllm_shares'], VLLM_SHORT)}"
        )
        lines.append(
            f"{'':<15}    decode (E2E - TTFT) p50 {r.get('decode_p50_s', float('nan')):.3f}s, "
            f"preemptions {r.get('preemptions', 0):.0f}"
        )
        if r["connector_shares"]:
            lines.append(f"{'':<15}    connector's sources: {_shares(r['connector_shares'])}")
        if r["service_cpu_s_per_request"] is not None:
            per_gib = r["service_cpu_s_per_gib_served"]
            lines.append(
                f"{'':<15}    service CPU {r['service_cpu_s_per_request'] * 1000:.1f} ms/request"
                + (f", {per_gib:.2f} s/GiB served" if per_gib else "")
            )
    for e in errors:
        lines.append(f"{e.name:<15} {e.replicas:>2} {e.router:<11} did not run: {e.error}")
    return "\n".join(lines)


def ratios(rows: Sequence[dict[str, Any]], against: Sequence[str] = ("alone", "lmcache-mp")) -> str:
    """Each configuration's figures over a baseline's of the same replicas and router."""
    keys = ("ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "requests_per_s")
    lines = []
    for base_name in against:
        for r in rows:
            base = next(
                (
                    b
                    for b in rows
                    if b["configuration"] == base_name and (b["replicas"], b["router"]) == (r["replicas"], r["router"])
                ),
                None,
            )
            if base is None or base is r:
                continue
            parts = [f"{k.removesuffix('_s').replace('_per', '/s')} x{r[k] / base[k]:.2f}" for k in keys if base[k]]
            where = f"({r['replicas']} replicas, {r['router']})"
            lines.append(f"{r['configuration']} / {base_name} {where}: " + ", ".join(parts))
    return "\n".join(lines)


def ttft_cdf_svg(results: Sequence[ConfigResult], title: str) -> str:
    """TTFT CDF per configuration (one line each; x: seconds on a log scale, from the
    decade below the fastest request to the decade above the slowest: the figures span
    two or three decades between a cached fleet and an overloaded one)."""
    width, height, left, top, plot_w, plot_h = 720, 420, 60, 40, 620, 300
    curves = []
    for r in results:
        ttft = sorted(o.ttft_s for o in r.outcomes if o.ok and o.ttft_s is not None)
        if ttft:
            curves.append((f"{r.name} ({r.replicas}, {r.router})", ttft))
    everything = [t for _, ttft in curves for t in ttft if t > 0] or [1.0]
    lo, hi = math.floor(math.log10(min(everything))), math.ceil(math.log10(max(everything)))
    hi = max(hi, lo + 1)

    def x_of(t: float) -> float:
        return left + plot_w * (math.log10(max(t, 10.0**lo)) - lo) / (hi - lo)

    svg = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}">',
        "<style>text { font-family: sans-serif; font-size: 11px; fill: #333; } .t { font-size: 13px; "
        "font-weight: bold; } .grid { stroke: #ddd; } .line { fill: none; stroke-width: 1.8; }</style>",
        f'<rect width="{width}" height="{height}" fill="#fff"/>',
        f'<text x="{left}" y="22" class="t">{html.escape(title)}</text>',
    ]
    for i in range(6):
        gy = top + plot_h * (1 - i / 5)
        svg.append(f'<line x1="{left}" y1="{gy:.1f}" x2="{left + plot_w}" y2="{gy:.1f}" class="grid"/>')
        svg.append(f'<text x="{left - 6}" y="{gy + 4:.1f}" text-anchor="end">{i / 5:.0%}</text>')
    for decade in range(lo, hi + 1):
        gx = x_of(10.0**decade)
        svg.append(f'<line x1="{gx:.1f}" y1="{top}" x2="{gx:.1f}" y2="{top + plot_h}" class="grid"/>')
        svg.append(f'<text x="{gx:.1f}" y="{top + plot_h + 14}" text-anchor="middle">{10.0**decade:g}</text>')
    svg.append(f'<text x="{left + plot_w / 2}" y="{top + plot_h + 30}" text-anchor="middle">TTFT (s, log)</text>')
    for i, (name, ttft) in enumerate(curves):
        colour = COLOURS[i % len(COLOURS)]
        points = [f"{x_of(ttft[0]):.1f},{top + plot_h:.1f}"]
        for k, t in enumerate(ttft):
            x = x_of(t)
            points.append(f"{x:.1f},{top + plot_h * (1 - k / len(ttft)):.1f}")
            points.append(f"{x:.1f},{top + plot_h * (1 - (k + 1) / len(ttft)):.1f}")
        svg.append(f'<polyline points="{" ".join(points)}" stroke="{colour}" class="line"/>')
        ly = top + plot_h + 50 + 14 * (i % 3)
        lx = left + 300 * (i // 3)
        svg.append(f'<rect x="{lx}" y="{ly - 8}" width="12" height="3" fill="{colour}"/>')
        svg.append(f'<text x="{lx + 16}" y="{ly}">{html.escape(name)}</text>')
    svg += ["</svg>", ""]
    return "\n".join(svg)


def describe_sources(result: ConfigResult) -> str:
    """Token accounting of one run: vLLM's sources against the prompt tokens sent."""
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(result.vllm_sources.items()))
