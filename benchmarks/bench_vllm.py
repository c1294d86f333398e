"""Time to first token of real vLLM OpenAI servers: cold, warm from another replica's
chunks through the daemon, and vLLM's own in-process prefix-cache hit, in one run.

``python benchmarks/bench_vllm.py [--sizes 1024,2048,4096] [--reps 3] [--codec MODE] [--json out.json]``

``--codec MODE`` starts the daemon with ``kv_codec: MODE`` (docs/codec.md): the
replicas' connectors read it from ``hello``, A encodes what it stores and B
decodes what it loads; warm B against cold A is then that mode's ratio (one
mode per run: the connectors read the codec once, at their first request).

Builds a local Llama (random weights, 8 layers, hidden 768, 12 heads, 4 KV
heads, MLP 2048: big enough that prefill dominates on a CPU), starts a
daemon and two vLLM 0.32 OpenAI servers (``.venv-vllm``, the command line of
docs/integrations.md), then per prompt size and repetition, with a fresh
random prefix of 90% of the prompt and three different 10% suffixes:

- **cold**: replica A, prefix + suffix 1 (nothing cached anywhere; A stores);
- **warm B**: replica B, a process that never saw the prefix, prefix + suffix 2:
  the prefix's chunks come from the daemon;
- **local hit**: replica A again, prefix + suffix 3: vLLM's own prefix cache,
  the ideal a single replica reaches alone.

TTFT is the latency of a ``/v1/completions`` request with ``max_tokens=1``.
B's time loading (``vllm:lmcache_server_load_s``, measured inside the
connector) is set against a raw contiguous ``get_into`` of the same number of
bytes, freshly stored, by the thin client in this process.  vLLM's native CPU offloading
(``OffloadingConnector``, ``SimpleCPUOffloadConnector``) refuses CPU-only
platforms in vLLM 0.32 ("CPU Offloading is currently only supported on
CUDA-alike and XPU GPUs"), so it has no row here; it keeps KV per process
anyway, so replica B could not reuse A's prefill with it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._harness import CpuMeter, descendants, free_port, raise_on_sigterm, workspace  # noqa: E402
from tests.integrations.vllm.vllm_harness.fixtures import doc_command, vllm_cli  # noqa: E402

VLLM_PYTHON = Path(os.environ.get("LMCACHE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
MODEL = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8}
MODEL_HEADS = {"num_attention_heads": 12, "num_key_value_heads": 4}
CHUNK = 256


def build_model(out: Path) -> Path:
    code = (
        "import sys; from pathlib import Path; from tests.integrations.vllm.vllm_harness.models import build;"
        f"build(Path(sys.argv[1]), 'llama', **{ {**MODEL, **MODEL_HEADS}!r})"
    )
    subprocess.run([str(VLLM_PYTHON), "-c", code, str(out)], cwd=ROOT, check=True, capture_output=True, timeout=600)
    return out


def post(url: str, body: dict[str, Any], timeout_s: float = 600) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as r:
        result: dict[str, Any] = json.loads(r.read())
    return result


def ttft(server: dict[str, Any], tokens: list[int]) -> float:
    started = time.perf_counter()
    post(server["url"] + "/v1/completions", {"model": server["model"], "prompt": tokens, "max_tokens": 1})
    return time.perf_counter() - started


def counters(server: dict[str, Any]) -> dict[str, float]:
    with urllib.request.urlopen(server["url"] + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:lmcache_server_"):
            name = line.split("{", 1)[0].split(" ", 1)[0].removeprefix("vllm:lmcache_server_").removesuffix("_total")
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def wait_ready(url: str, proc: Any, log: Path, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"vLLM server at {url} not ready")


def start_servers(procs: Any, commands: dict[str, str], model: Path, address: str) -> list[dict[str, Any]]:
    """One vLLM OpenAI server per ``commands`` entry (a shell command line of
    docs/integrations.md), on a free port, the daemon at ``address``; returned once
    every one answers ``/health``: dicts of ``name``, ``url``, ``child``, ``model``."""
    servers = []
    for name, command in commands.items():
        http = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "VLLM_"))}
        env.update(
            MODEL=str(model),
            PORT=str(http),
            LMCACHE_SERVER_ADDRESS=address,
            VLLM_CPU_KVCACHE_SPACE="2",
            PATH=f"{vllm_cli(VLLM_PYTHON)}:{VLLM_PYTHON.parent}:{env.get('PATH', '')}",  # `vllm serve` too
        )
        procs.env = env
        child = procs.start(f"vllm-{name}", ["bash", "-c", command], cwd=ROOT)
        servers.append({"name": name, "url": f"http://127.0.0.1:{http}", "child": child, "model": str(model)})
    for s in servers:
        print(f"waiting for vLLM server {s['name']} ...", file=sys.stderr, flush=True)
        wait_ready(s["url"], s["child"].proc, s["child"].log_path)
    return servers


def raw_get_s(address: str, chunk_bytes: int, n_chunks: int, reps: int = 5) -> float:
    """Median seconds of a contiguous ``get_into`` of ``n_chunks`` chunks (the bytes B
    loads) by the thin client, each repetition reading chunks stored just before, as B
    reads chunks it never saw (so both touch those pool pages for the first time)."""
    from lmcache_client import CacheClient

    data = [bytearray(os.urandom(chunk_bytes)) for _ in range(n_chunks)]
    out = [bytearray(chunk_bytes) for _ in range(n_chunks)]
    times = []
    with CacheClient(address, "bench-vllm|raw", timeout_s=60, fail_open=False) as c:
        for _ in range(reps + 1):
            keys = [os.urandom(32) for _ in range(n_chunks)]
            c.put(keys, data)
            started = time.perf_counter()
            assert all(c.get_into(keys, out))
            times.append(time.perf_counter() - started)
            c.delete(keys)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1024,2048,4096")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--codec", default="none", help="the daemon's kv_codec (none, lossless, int8, cachegen)")
    args = parser.parse_args(argv)
    raise_on_sigterm()
    if not VLLM_PYTHON.exists():
        print(f"needs vLLM's venv at {VLLM_PYTHON}: make setup-vllm", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",")]
    results: list[dict[str, Any]] = []
    with workspace("bench-vllm-") as (procs, work):
        print("building the model ...", file=sys.stderr, flush=True)
        model = build_model(work / "llama-8L-768")
        port = free_port()
        address = f"tcp://127.0.0.1:{port}"
        daemon = procs.start(
            "daemon",
            [sys.executable, "-m", "lmcache_server", "--set", f"listen=[tcp://127.0.0.1:{port}]"]
            + ["--set", "max_local_cpu_size=4GiB", "--set", "metrics_port=0", "--set", "cache_policy=lru"]
            + ["--set", f"kv_codec={args.codec}"],
        )
        print(f"daemon kv_codec: {args.codec}", flush=True)
        servers = start_servers(
            procs, {"a": doc_command(), "b": doc_command("vllm-replica-command-cpu")}, model, address
        )
        daemon.check_alive()
        a, b = servers
        meter = CpuMeter(lambda: descendants([c.proc.pid for c in procs.children]))
        rng = random.Random(0)
        # Warm-up, not measured: each server's first request, B's first load (it maps the
        # daemon's pool and starts its copy threads) and A's first store.
        warmup = [rng.randrange(3, 1024) for _ in range(600)]
        ttft(a, warmup)
        ttft(b, warmup + [5])
        for size in sizes:
            for rep in range(args.reps):
                prefix = [rng.randrange(3, 1024) for _ in range(size * 9 // 10)]
                suffixes = [[rng.randrange(3, 1024) for _ in range(size - len(prefix))] for _ in range(3)]
                stored_before = counters(a).get("stored_chunks", 0)
                cold = ttft(a, prefix + suffixes[0])
                stored = counters(a).get("stored_chunks", 0) - stored_before
                if not stored:
                    print(f"replica A stored nothing; its log ends:\n{a['child'].log_tail(40)}", file=sys.stderr)
                before = counters(b)
                warm = ttft(b, prefix + suffixes[1])
                after = counters(b)
                local = ttft(a, prefix + suffixes[2])
                loaded = after.get("loaded_tokens", 0) - before.get("loaded_tokens", 0)
                load_s = after.get("load_s", 0) - before.get("load_s", 0)
                n_chunks = int(loaded) // CHUNK
                chunk_bytes = int(after.get("loaded_bytes", 0) - before.get("loaded_bytes", 0)) // max(1, n_chunks)
                raw = raw_get_s(address, chunk_bytes, n_chunks) if n_chunks else 0.0
                row = {
                    "tokens": size,
                    "rep": rep,
                    "cold_s": cold,
                    "warm_b_s": warm,
                    "local_hit_s": local,
                    "stored_chunks_a": stored,
                    "loaded_tokens": loaded,
                    "load_s": load_s,
                    "raw_get_s": raw,
                    "loaded_mib": n_chunks * chunk_bytes / 2**20,
                }
                results.append(row)
                print(
                    f"{size} tokens rep {rep}: cold {cold:.3f}s, warm B {warm:.3f}s ({warm / cold:.2f}x), "
                    f"local hit {local:.3f}s; A stored {stored:.0f} chunks, B loaded {loaded:.0f} tokens "
                    f"({row['loaded_mib']:.0f} MiB) in {load_s * 1000:.1f} ms, raw get {raw * 1000:.1f} ms",
                    flush=True,
                )
        outside = meter.outside_load()
    print(f"\nkv_codec {args.codec}; other load during the run: {outside:.2f} cores (2-core machine)")
    print(f"medians of {args.reps}")
    header = (
        f"{'tokens':>6} {'reused':>6} {'cold':>8} {'warm B':>8} {'B/cold':>7} {'local':>8} "
        f"{'local/cold':>10} {'B load':>8} {'raw get':>8} {'load/raw':>8}"
    )
    print(header)
    for size in sizes:
        rows = [r for r in results if r["tokens"] == size]

        def med(key: str, rows: list[dict[str, Any]] = rows) -> float:
            return statistics.median(r[key] for r in rows)

        ratio = statistics.median(r["warm_b_s"] / r["cold_s"] for r in rows)
        local_ratio = statistics.median(r["local_hit_s"] / r["cold_s"] for r in rows)
        load_ratio = med("load_s") / med("raw_get_s") if med("raw_get_s") else float("nan")
        print(
            f"{size:>6} {med('loaded_tokens'):>6.0f} {med('cold_s'):>7.3f}s {med('warm_b_s'):>7.3f}s {ratio:>7.2f} "
            f"{med('local_hit_s'):>7.3f}s {local_ratio:>10.2f} {med('load_s') * 1000:>6.1f}ms "
            f"{med('raw_get_s') * 1000:>6.1f}ms {load_ratio:>8.2f}"
        )
    if args.json:
        out = {"codec": args.codec, "rows": results, "outside_load_cores": outside}
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
