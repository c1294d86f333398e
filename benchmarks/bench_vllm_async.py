"""Decode latency while other requests load and save through the vLLM connector:
no transfers, synchronous and asynchronous transfers, in one run (issue 30, item 9).

``.venv-vllm/bin/python benchmarks/bench_vllm_async.py [--quick] [--reps N] [--json out.json]``

Builds a small local Llama (random weights, bench_vllm's builder in
tests/integrations/vllm/vllm_harness/models.py), starts one daemon, then runs each
setting in a fresh process of vLLM's venv: one offline ``vllm.LLM`` whose engine
core runs in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), vLLM's own
prefix cache off, driven step by step (``add_request`` / ``step``):

- **none**: a stream of ``--decoders`` decoding requests (short prompts,
  ``--decode-tokens`` tokens each), nothing else; no connector;
- **sync**: the same decoding stream while ``--loaders`` requests arrive, one every
  ``--gap-steps`` steps; each is a long prefix whose chunks the daemon holds (a
  warm-up generation in the same process stored them) plus a long new suffix,
  so each loads the prefix and saves the suffix's chunks; connector with
  ``async_transfers: false`` (lookups, loads and saves inside vLLM's step);
- **async**: the same with ``async_transfers: true`` (the default);
- **sync-lw**, **async-lw**: sync and async with ``layerwise_save: true`` (each
  layer of a step's saves copied out at ``save_kv_layer`` during the forward
  pass, then stored from host staging);
- **local** (not a transfer setting; leave it out with ``--settings``): the same
  loaders with vLLM's own prefix cache on and no connector, their prefixes
  warmed in that cache: the same compute as sync and async with no transfers,
  so async/local isolates what the transfers cost from what the loaders'
  suffix prefill costs (on a CPU a prefill step holds every decode anyway).

Each setting's loaders get fresh random prompts of the same lengths (a setting
never finds another's chunks); the decoding prompts are the same everywhere.

Measured per setting, from ``time.perf_counter()`` after each ``step()``: the
decoding requests' inter-token latency (p50, p99, max; the first token is not
an inter-token gap), the loaders' TTFT (add to first token), the steps and
their total time, and the time the connector's methods took inside them: the
scheduler connector's ``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``build_connector_meta``, ``request_finished``,
``update_connector_output``, and the worker connector's ``handle_preemptions``,
``start_load_kv``, ``save_kv_layer``, ``wait_for_save``, ``get_finished``,
``get_block_ids_with_load_errors`` (the class's methods wrapped with timers in
the benchmark process), each as a share of the total step time.  Target (issue
30): async p99 within 1.2x of none where sync is worse, and the scheduler's
connector share under 1%.

The machine here has 2 cores: the worker's copy threads compete with the
forward pass for them, so what asynchronous transfers hide on a GPU (copies on
their own engine) is partly paid on a CPU anyway.  ``--quick`` is a smoke run
(about 3 minutes); with ``--reps N`` the settings run N times in rotated order
and the table gives medians.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._harness import (  # noqa: E402
    CpuMeter,
    free_port,
    percentile,
    raise_on_sigterm,
    wait_until,
    workspace,
)

VLLM_PYTHON = Path(os.environ.get("LMCACHE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
SERVER_PYTHON = Path(os.environ.get("LMCACHE_SERVER_PYTHON", ROOT / ".venv" / "bin" / "python"))
"""The daemon's interpreter: the main venv (vLLM's venv has the client only)."""
# Full multi-head attention and a small MLP: 32 KiB of fp32 KV per token for little
# compute, so the transfers are a visible part of a step (Llama-3.1-8B: 128 KiB of
# bf16 KV per token for far more compute per token).
MODEL = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
}
DTYPE = "float32"
CHUNK = 256
SETTINGS = ("none", "sync", "async", "sync-lw", "async-lw", "local")
TRANSFER_SETTINGS = ("sync", "async", "sync-lw", "async-lw")
SCHEDULER_CALLS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
    "update_connector_output",
)
WORKER_CALLS = (
    "handle_preemptions",
    "start_load_kv",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
)
CONNECTOR = {
    "kv_connector": "LMCacheServerConnectorV1",
    "kv_connector_module_path": "lmcache_client.integrations.vllm.connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}
CHILD_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "TOKENIZERS_PARALLELISM": "false",
}


# -- the child: one setting in one process of vLLM's venv ----------------------------------------
class ConnectorClock:
    """Seconds and calls of the connector's methods, by role, in this process: the
    class's methods are wrapped (vLLM builds a scheduler and a worker instance)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def install(self) -> None:
        from lmcache_client.integrations.vllm.connector import LMCacheServerConnectorV1 as cls

        for name in SCHEDULER_CALLS + WORKER_CALLS:
            setattr(cls, name, self._timed(name, getattr(cls, name)))

    def _timed(self, name: str, original: Any) -> Any:
        clock = self

        @functools.wraps(original)
        def timed(connector: Any, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(connector, *args, **kwargs)
            finally:
                role = "scheduler" if connector.scheduler is not None else "worker"
                key = f"{role}.{name}"
                clock.seconds[key] = clock.seconds.get(key, 0.0) + time.perf_counter() - started
                clock.calls[key] = clock.calls.get(key, 0) + 1

        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def total(self, role: str) -> float:
        return sum(s for k, s in self.seconds.items() if k.startswith(role + "."))


def worker_totals() -> dict[str, float]:
    """The worker connector's counters so far (loaded tokens, stored chunks, ...)."""
    from tests.integrations.vllm.vllm_harness.replica import _counters

    return dict(_counters().get("worker", {}))


def child_main(spec_path: Path, out_path: Path) -> int:
    for k, v in CHILD_ENV.items():  # before vLLM is imported
        os.environ.setdefault(k, v)
    spec = json.loads(spec_path.read_text())
    clock = ConnectorClock()
    clock.install()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from tests.integrations.vllm.vllm_harness.replica import settle

    setting = spec["setting"]
    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "dtype": DTYPE,
        "max_model_len": spec["max_model_len"],
        "enforce_eager": True,
        "distributed_executor_backend": "uni",
        "enable_prefix_caching": setting == "local",
        "seed": 0,
    }
    if setting in TRANSFER_SETTINGS:
        extra = {"address": spec["address"], "async_transfers": setting.startswith("async")}
        if setting.endswith("-lw"):
            extra["layerwise_save"] = True
        kwargs["kv_transfer_config"] = KVTransferConfig(**CONNECTOR, kv_connector_extra_config=extra)
    started = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - started
    engine = llm.llm_engine

    def generate(tokens: list[int], max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
        settle(llm)

    # Warm-up, not measured: the engine's first request, and (settings with loaders) one
    # store and one load end to end (the worker maps the daemon's pool, starts its
    # threads), then the loaders' prefixes: the daemon (or vLLM's cache) holds them.
    started = time.perf_counter()
    generate(spec["warm"], 4)
    loaders = spec["loaders"]
    if loaders:
        generate(spec["warm_prefix"], 1)
        generate(spec["warm_prefix"] + spec["warm"], 1)
        for prefix, _ in loaders:
            generate(prefix, 1)
    warmup_s = time.perf_counter() - started

    before = worker_totals()
    decode_params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=spec["decode_tokens"])
    loader_params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=spec["loader_tokens"])
    times: dict[str, list[float]] = {}
    added: dict[str, float] = {}
    decoders = [f"decode-{i}" for i in range(len(spec["decoders"]))]
    clock.reset()
    for rid, prompt in zip(decoders, spec["decoders"]):
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), decode_params)
        added[rid] = time.perf_counter()
    steps, step_s, streaming_steps, next_loader = 0, 0.0, 0, 0
    deadline = time.monotonic() + spec["timeout_s"]
    while engine.has_unfinished_requests() or next_loader < len(loaders):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{setting}: the requests did not finish in {spec['timeout_s']} s")
        # Loader i arrives once the stream has decoded lead + i * gap steps.
        if next_loader < len(loaders) and streaming_steps >= spec["lead_steps"] + next_loader * spec["gap_steps"]:
            prefix, suffix = loaders[next_loader]
            rid = f"load-{next_loader}"
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prefix + suffix), loader_params)
            added[rid] = time.perf_counter()
            next_loader += 1
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        steps += 1
        step_s += t1 - t0
        for output in outputs:
            seen = times.setdefault(output.request_id, [])
            seen.extend([t1] * (len(output.outputs[0].token_ids) - len(seen)))
        if all(times.get(rid) for rid in decoders):
            streaming_steps += 1
    connector_s = {role: clock.total(role) for role in ("scheduler", "worker")}
    methods = {k: {"seconds": s, "calls": clock.calls[k]} for k, s in sorted(clock.seconds.items())}
    settle(llm)  # saves still in flight finish here, not timed
    after = worker_totals()
    itl = [b - a for rid in decoders for a, b in zip(times[rid], times[rid][1:])]
    ttft = [times[f"load-{i}"][0] - added[f"load-{i}"] for i in range(len(loaders))]
    result = {
        "setting": setting,
        "rep": spec["rep"],
        "itl_s": itl,
        "ttft_s": ttft,
        "steps": steps,
        "step_s": step_s,
        "connector_s": connector_s,
        "connector_methods": methods,
        "loaded_tokens": after.get("loaded_tokens", 0) - before.get("loaded_tokens", 0),
        "stored_chunks": after.get("stored_chunks", 0) - before.get("stored_chunks", 0),
        "load_failed_tokens": after.get("load_failed_tokens", 0) - before.get("load_failed_tokens", 0),
        "saves_dropped": after.get("saves_dropped", 0) - before.get("saves_dropped", 0),
        "startup_s": startup_s,
        "warmup_s": warmup_s,
        "max_num_batched_tokens": llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
    }
    out_path.write_text(json.dumps(result))
    return 0


# -- the parent: model, daemon, one child per setting, the table ---------------------------------
def vllm_python() -> Path:
    """This interpreter when it has vLLM (run from .venv-vllm), else vLLM's venv."""
    return Path(sys.executable) if importlib.util.find_spec("vllm") else VLLM_PYTHON


def build_model(python: Path, out: Path) -> Path:
    code = (
        "import sys; from pathlib import Path; from tests.integrations.vllm.vllm_harness.models import build;"
        f"build(Path(sys.argv[1]), 'llama', **{MODEL!r})"
    )
    subprocess.run([str(python), "-c", code, str(out)], cwd=ROOT, check=True, capture_output=True, timeout=600)
    return out


def start_daemon(procs: Any, port: int) -> None:
    """The daemon on ``port``, from the main venv; returns once it answers a ping."""
    from lmcache_client import CacheClient, DaemonUnavailable

    python = SERVER_PYTHON if SERVER_PYTHON.exists() else Path(sys.executable)
    argv = [str(python), "-m", "lmcache_server", "--listen", f"tcp://127.0.0.1:{port}", "--metrics-port", "0"]
    child = procs.start("daemon", argv + ["--set", "max_local_cpu_size=6GiB", "--set", "cache_policy=lru"], cwd=ROOT)

    def up() -> bool:
        try:
            with CacheClient(f"tcp://127.0.0.1:{port}", "bench|ping", timeout_s=0.3, fail_open=False) as c:
                c.ping(timeout_s=0.3)
            return True
        except DaemonUnavailable:
            return False

    wait_until(up, 60, "the daemon to answer", child.check_alive)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1024) for _ in range(n)]


def run_child(procs: Any, python: Path, work: Path, spec: dict[str, Any]) -> dict[str, Any]:
    name = f"{spec['setting']}-{spec['rep']}"
    spec_path, out_path = work / f"{name}.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "VLLM_"))}
    env.update(CHILD_ENV)
    procs.env = env
    child = procs.start(name, [str(python), str(Path(__file__).resolve()), "--child", str(spec_path), str(out_path)])
    try:
        rc = child.proc.wait(spec["timeout_s"] + 600)
    except subprocess.TimeoutExpired:
        procs.stop(child)
        rc = -1
    if rc != 0 or not out_path.exists():
        raise RuntimeError(f"setting {name} failed ({rc}); its log ends:\n{child.log_tail(40)}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repetitions of one setting."""

    def med(f: Any) -> float:
        return float(statistics.median(f(r) for r in rows))

    return {
        "itl_p50_ms": med(lambda r: percentile(r["itl_s"], 50) * 1000),
        "itl_p99_ms": med(lambda r: percentile(r["itl_s"], 99) * 1000),
        "itl_max_ms": med(lambda r: max(r["itl_s"]) * 1000),
        "ttft_s": med(lambda r: statistics.median(r["ttft_s"])) if rows[0]["ttft_s"] else None,
        "steps": med(lambda r: r["steps"]),
        "step_s": med(lambda r: r["step_s"]),
        "scheduler_share": med(lambda r: r["connector_s"]["scheduler"] / r["step_s"]),
        "worker_share": med(lambda r: r["connector_s"]["worker"] / r["step_s"]),
        "loaded_tokens": med(lambda r: r["loaded_tokens"]),
        "stored_chunks": med(lambda r: r["stored_chunks"]),
    }


def report(summary: dict[str, dict[str, Any]], outside_cores: float) -> dict[str, float]:
    """Print the table, the p99 ratios and the targets' verdicts; returns the ratios."""
    print(
        f"{'setting':<8} {'ITL p50':>9} {'ITL p99':>9} {'ITL max':>9} {'loader TTFT':>11} {'steps':>6} "
        f"{'step time':>9} {'sched conn':>10} {'worker conn':>11} {'loaded':>7} {'stored':>6}"
    )
    for s, m in summary.items():
        ttft = "-" if m["ttft_s"] is None else f"{m['ttft_s']:.2f}s"
        print(
            f"{s:<8} {m['itl_p50_ms']:>7.1f}ms {m['itl_p99_ms']:>7.1f}ms {m['itl_max_ms']:>7.1f}ms "
            f"{ttft:>11} {m['steps']:>6.0f} {m['step_s']:>8.2f}s {m['scheduler_share'] * 100:>9.2f}% "
            f"{m['worker_share'] * 100:>10.2f}% {m['loaded_tokens']:>7.0f} {m['stored_chunks']:>6.0f}"
        )
    ratios: dict[str, float] = {}
    for base in ("none", "local"):
        for s in TRANSFER_SETTINGS:
            if base in summary and s in summary:
                ratios[f"p99_{s}/{base}"] = summary[s]["itl_p99_ms"] / summary[base]["itl_p99_ms"]
    if ratios:
        print("p99 ITL ratios: " + ", ".join(f"{k.removeprefix('p99_')} {v:.2f}x" for k, v in ratios.items()))
    if "p99_async/none" in ratios and "p99_sync/none" in ratios:
        met = ratios["p99_async/none"] <= 1.2 < ratios["p99_sync/none"]
        print(f"target async p99 <= 1.2x none, sync worse: {'met' if met else 'missed'}")
    for s in ("sync", "async"):
        if s in summary and f"{s}-lw" in summary:
            lw = summary[f"{s}-lw"]["itl_p99_ms"] / summary[s]["itl_p99_ms"]
            steps = summary[f"{s}-lw"]["step_s"] / summary[s]["step_s"]
            print(f"layer-wise saves ({s}): p99 ITL {lw:.2f}x, total step time {steps:.2f}x the gather after the step")
    for s in TRANSFER_SETTINGS:
        if s in summary:
            share = summary[s]["scheduler_share"] * 100
            verdict = "met" if share < 1 else "missed"
            print(f"{s}: the scheduler's connector calls take {share:.2f}% of step time (target < 1%: {verdict})")
    if outside_cores > 0.5:
        print(f"warning: other processes took {outside_cores:.2f} cores during the run: the ratios are mostly noise")
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--decoders", type=int, default=4, help="decoding requests (short prompts)")
    parser.add_argument("--decode-tokens", type=int, default=128, help="tokens each decoding request generates")
    parser.add_argument("--loaders", type=int, default=4, help="loading requests arriving during the decode")
    parser.add_argument("--prefix-tokens", type=int, default=3072, help="each loader's prefix, held by the daemon")
    parser.add_argument("--suffix-tokens", type=int, default=1024, help="each loader's new suffix (computed, saved)")
    parser.add_argument("--gap-steps", type=int, default=12, help="decode steps between two loaders' arrivals")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"any of {','.join(SETTINGS)}")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a small run (2 loaders of 2K + 512 tokens, 64 tokens)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(*args.child)
    if args.quick:
        args.decode_tokens, args.loaders, args.prefix_tokens, args.suffix_tokens, args.gap_steps = 64, 2, 2048, 512, 8
    settings = [s for s in args.settings.split(",") if s]
    if unknown := set(settings) - set(SETTINGS):
        parser.error(f"unknown settings {sorted(unknown)}")
    raise_on_sigterm()
    python = vllm_python()
    if not python.exists():
        print(f"needs vLLM's venv at {VLLM_PYTHON}: make setup-vllm", file=sys.stderr)
        return 2
    lead_steps = 4
    if args.decode_tokens < lead_steps + args.loaders * args.gap_steps + 8:
        parser.error("--decode-tokens too small: the decoding stream must outlast the loaders' arrivals")
    rng = random.Random(0)
    decoders = [tokens(rng, 32 + 8 * i) for i in range(args.decoders)]
    results: list[dict[str, Any]] = []
    with workspace("bench-vllm-async-") as (procs, work):
        print("building the model ...", file=sys.stderr, flush=True)
        model = build_model(python, work / "llama-mha-8L-512")
        port = free_port()
        start_daemon(procs, port)
        meter = CpuMeter(lambda: [c.proc.pid for c in procs.children if c.proc.poll() is None])
        for rep in range(args.reps):
            order = settings[rep % len(settings) :] + settings[: rep % len(settings)]
            for setting in order:
                seeded = random.Random(f"{setting}-{rep}")
                with_loaders = setting != "none"
                spec = {
                    "setting": setting,
                    "rep": rep,
                    "model": str(model),
                    "max_model_len": args.prefix_tokens + args.suffix_tokens + 256,
                    "address": f"tcp://127.0.0.1:{port}",
                    "warm": tokens(seeded, 48),
                    "warm_prefix": tokens(seeded, 2 * CHUNK),
                    "decoders": decoders,
                    "decode_tokens": args.decode_tokens,
                    "loaders": [
                        (tokens(seeded, args.prefix_tokens), tokens(seeded, args.suffix_tokens))
                        for _ in range(args.loaders if with_loaders else 0)
                    ],
                    "loader_tokens": 4,
                    "lead_steps": lead_steps,
                    "gap_steps": args.gap_steps,
                    "timeout_s": 1800,
                }
                print(f"rep {rep}: {setting} ...", file=sys.stderr, flush=True)
                row = run_child(procs, python, work, spec)
                results.append(row)
                print(
                    f"  {setting}: ITL p50 {percentile(row['itl_s'], 50) * 1000:.1f} ms, "
                    f"p99 {percentile(row['itl_s'], 99) * 1000:.1f} ms, {row['steps']} steps, "
                    f"loaded {row['loaded_tokens']:.0f} tokens, stored {row['stored_chunks']:.0f} chunks "
                    f"(LLM start {row['startup_s']:.0f} s, warm-up {row['warmup_s']:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
        outside = meter.outside_load()
    summary = {s: summarize([r for r in results if r["setting"] == s]) for s in settings}
    batched = results[0]["max_num_batched_tokens"] if results else None
    print(
        f"\n{args.decoders} decoding requests x {args.decode_tokens} tokens; {args.loaders} loaders of "
        f"{args.prefix_tokens} held + {args.suffix_tokens} new tokens, one every {args.gap_steps} steps; "
        f"Llama {MODEL['num_hidden_layers']}L-{MODEL['hidden_size']} MHA {DTYPE}, "
        f"max_num_batched_tokens {batched}; medians of {args.reps}; "
        f"other load during the run: {outside:.2f} cores (2-core machine)"
    )
    ratios = report(summary, outside)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "child")}
        out = {"config": {**config, "model": MODEL, "dtype": DTYPE}, "summary": summary, "ratios": ratios}
        args.json.write_text(json.dumps({**out, "runs": results, "outside_load_cores": outside}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
