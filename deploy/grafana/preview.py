"""Draw deploy/grafana/lmcache.json as an SVG from a real Prometheus, without Grafana.

    python deploy/grafana/preview.py --prometheus http://127.0.0.1:9090 --minutes 5 --out dashboard.svg

Each panel's own queries run against Prometheus's range API (``$instance`` is every
daemon, ``$__rate_interval`` and ``$__range`` as given), laid out on the dashboard's
grid: stat panels show the last value, time series their lines with the legend. It
is a faithful sketch of what the dashboard shows, not Grafana's rendering (no Grafana
runs where the docs are built); docs/operations.md's picture was made with it.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parent / "lmcache.json"
COLUMN_PX, ROW_PX, PAD = 50, 28, 6
LEGEND_LINES = 4
COLOURS = ("#73bf69", "#f2cc0c", "#5794f2", "#ff780a", "#b877d9", "#f2495c", "#8ab8ff", "#96d98d")
Series = list[tuple[str, list[tuple[float, float]]]]


def fetch(prometheus: str, expr: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
    """The result of one range query (a list of {metric, values})."""
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step_s})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{params}", timeout=30) as reply:
        body = json.loads(reply.read())
    if body["status"] != "success":
        raise RuntimeError(f"{expr}: {body}")
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def panel_series(prometheus: str, panel: dict[str, Any], start: float, end: float, rate_s: int) -> Series:
    """Every series a panel's targets return, named by their legendFormat."""
    out: Series = []
    step_s = max(1.0, (end - start) / 120)
    for target in panel.get("targets", []):
        expr = target["expr"].replace("$__rate_interval", f"{rate_s}s")
        expr = expr.replace("$__range", f"{int(end - start)}s").replace('=~"$instance"', '=~".*"')
        legend = target.get("legendFormat", "")
        for series in fetch(prometheus, expr, start, end, step_s):
            out.append((legend_name(legend, series["metric"]), [(float(t), float(v)) for t, v in series["values"]]))
    return out


def legend_name(legend: str, labels: dict[str, str]) -> str:
    """A legendFormat with its {{label}}s filled in (a label the series lacks prints as nothing)."""
    return re.sub(r"\{\{ *(\w+) *\}\}", lambda m: labels.get(m.group(1), ""), legend).strip()


def fmt(value: float, unit: str) -> str:
    """A value as Grafana's unit would print it (the few units the dashboard uses)."""
    if unit == "percentunit":
        return f"{value * 100:.1f}%"
    if unit in ("bytes", "Bps"):
        for prefix in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(value) < 1024 or prefix == "TiB":
                return f"{value:.3g} {prefix}" + ("/s" if unit == "Bps" else "")
            value /= 1024
    if unit == "s":
        return f"{value * 1000:.3g} ms" if abs(value) < 1 else f"{value:.4g} s"
    suffix = {"ops": " ops/s", "reqps": " req/s"}.get(unit, "")
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{prefix}{suffix}"
    return f"{value:.3g}{suffix}"


def draw_panel(panel: dict[str, Any], series: Series, start: float, end: float) -> list[str]:
    g = panel["gridPos"]
    x, y, w, h = g["x"] * COLUMN_PX, g["y"] * ROW_PX, g["w"] * COLUMN_PX - PAD, g["h"] * ROW_PX - PAD
    title = html.escape(panel["title"])
    if panel["type"] == "row":
        return [f'<text x="{x + 4}" y="{y + 19}" class="row">{title}</text>']
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
    svg = [f'<rect x="{x}" y="{y}" width="{w}" height="{h}" class="panel"/>',
           f'<text x="{x + 8}" y="{y + 17}" class="title">{title}</text>']  # fmt: skip
    if panel["type"] == "stat":
        last = [values[-1][1] for _, values in series if values]
        text = fmt(last[0], unit) if last else "No data"
        svg.append(f'<text x="{x + w / 2}" y="{y + h / 2 + 18}" class="stat">{html.escape(text)}</text>')
        return svg
    shown = min(len(series), LEGEND_LINES)
    plot_x, plot_y, plot_w, plot_h = x + 64, y + 28, w - 76, h - 28 - 30 - 13 * shown
    values = [v for _, points in series for _, v in points]
    if not values:
        svg.append(f'<text x="{x + w / 2}" y="{y + h / 2}" class="nodata">No data</text>')
        return svg
    low, high = min(0.0, min(values)), max(values)
    high = high if high > low else low + 1
    svg.append(f'<rect x="{plot_x}" y="{plot_y}" width="{plot_w}" height="{plot_h}" class="plot"/>')
    for frac in (0.0, 0.5, 1.0):
        ty = plot_y + plot_h * (1 - frac)
        svg.append(f'<text x="{plot_x - 4}" y="{ty + 4}" class="axis">{fmt(low + frac * (high - low), unit)}</text>')
    for t, anchor in ((start, "start"), (end, "end")):  # the time axis: its two ends, UTC
        tx = plot_x + plot_w * (t - start) / (end - start)
        clock = time.strftime("%H:%M:%S", time.gmtime(t))
        svg.append(f'<text x="{tx}" y="{plot_y + plot_h + 14}" class="axis" text-anchor="{anchor}">{clock}</text>')
    for i, (name, points) in enumerate(series):
        colour = COLOURS[i % len(COLOURS)]
        path = " ".join(
            f"{plot_x + plot_w * (t - start) / (end - start):.1f},{plot_y + plot_h * (high - v) / (high - low):.1f}"
            for t, v in points
        )
        svg.append(f'<polyline points="{path}" stroke="{colour}" class="line"/>')
        if i < shown:  # the legend: the first few series (the rest are drawn, not named)
            more = f" (+{len(series) - shown} more)" if i == shown - 1 and len(series) > shown else ""
            ly = plot_y + plot_h + 30 + 13 * i
            svg.append(f'<rect x="{plot_x}" y="{ly - 8}" width="10" height="3" fill="{colour}"/>')
            svg.append(f'<text x="{plot_x + 14}" y="{ly}" class="legend">{html.escape(name + more)}</text>')
    return svg


STYLE = """<style>
text { font-family: sans-serif; fill: #d8d9da; }
.panel { fill: #181b1f; stroke: #2c3235; } .plot { fill: none; stroke: #2c3235; }
.title { font-size: 12px; font-weight: bold; } .row { font-size: 14px; font-weight: bold; }
.stat { font-size: 26px; text-anchor: middle; fill: #73bf69; } .nodata { font-size: 12px; text-anchor: middle; }
.axis { font-size: 9px; text-anchor: end; fill: #8e8e8e; } .legend { font-size: 10px; }
.line { fill: none; stroke-width: 1.5; } .note { font-size: 11px; fill: #8e8e8e; }
</style>"""


def render(prometheus: str, start: float, end: float, rate_s: int = 10, note: str = "") -> str:
    """The whole dashboard over [start, end] as one SVG document."""
    dashboard = json.loads(DASHBOARD.read_text())
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"])
    width, height = 24 * COLUMN_PX, bottom * ROW_PX + 40
    body = []
    for panel in dashboard["panels"]:
        body += draw_panel(panel, panel_series(prometheus, panel, start, end, rate_s), start, end)
    caption = note or f"{dashboard['title']}: drawn by deploy/grafana/preview.py, not Grafana"
    lines = [html.escape(line) for line in caption.split("\n")]
    height += 16 * (len(lines) - 1)
    return "\n".join(
        [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         f'viewBox="0 0 {width} {height}">', STYLE, f'<rect width="{width}" height="{height}" fill="#111217"/>',
         *body, *(f'<text x="6" y="{height - 14 - 16 * (len(lines) - 1 - i)}" class="note">{line}</text>'
                  for i, line in enumerate(lines)), "</svg>", ""]
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prometheus", required=True, help="Prometheus base URL, e.g. http://127.0.0.1:9090")
    parser.add_argument("--minutes", type=float, default=5.0, help="the window ending now (default 5)")
    parser.add_argument("--rate-interval-s", type=int, default=10, help="what $__rate_interval stands for")
    parser.add_argument("--note", default="", help="the caption under the picture")
    parser.add_argument("--out", type=Path, required=True, help="the SVG file to write")
    args = parser.parse_args()
    end = time.time()
    args.out.write_text(render(args.prometheus, end - 60 * args.minutes, end, args.rate_interval_s, args.note))


if __name__ == "__main__":
    main()
