"""Prefill/decode disaggregation through the daemon against one vLLM instance doing both,
with real vLLM 0.32 OpenAI servers, in one run.

``python benchmarks/bench_pd.py [--sizes 2048,4096] [--reps 3] [--tokens 32] [--json out.json]``

Builds the local Llama of bench_vllm.py (random weights, 8 layers, hidden
768: prefill dominates on a CPU), starts a daemon, a producer and a consumer
(the PD command lines of docs/integrations.md) and a plain vLLM instance
without the connector (the same command without ``--kv-transfer-config``).
Requests go to the plain instance directly and, for PD, as
tests/integrations/vllm/vllm_harness/pd_proxy.py sends them (producer with ``max_tokens=1``,
then the consumer), from this process, so no relay sits in the timings.
All requests stream; per prompt size and repetition, with a fresh random
prompt each time:

- **TTFT**: request sent to first streamed token (PD: the producer's whole
  prefill, then the consumer's load and its one-token prefill);
- **ITL**: mean gap between the following tokens (decode speed);
- **decode stall**: a short request decoding ``4 * --tokens`` tokens while a
  long prompt of the size arrives: the largest gap between its tokens.  One
  instance prefills the long prompt between its decode steps; the PD
  consumer only loads it.

Ratios are PD / single.  On 2 CPU cores the producer, the consumer and the
plain instance share the same cores (only one works at a time, except
during the decode-stall rows, where the producer's prefill competes with
the consumer's decode for the CPU: on separate GPUs it would not).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._harness import free_port, raise_on_sigterm, workspace  # noqa: E402
from benchmarks.bench_vllm import VLLM_PYTHON, build_model, counters, start_servers  # noqa: E402
from tests.integrations.vllm.vllm_harness.fixtures import doc_command  # noqa: E402


def stream(url: str, model: str, tokens: list[int], n: int, times: list[float] | None = None) -> list[float]:
    """Stream a greedy completion; the arrival time (perf_counter) of each token, appended
    to ``times`` as they arrive."""
    body = {
        "model": model,
        "prompt": tokens,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    times = [] if times is None else times
    with urllib.request.urlopen(request, timeout=900) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("choices") and event["choices"][0].get("text"):
                times.append(time.perf_counter())
    return times


def ttft_itl(url: str, model: str, tokens: list[int], n: int, prefill_url: str | None = None) -> tuple[float, float]:
    """Time to the first token and mean inter-token gap; with ``prefill_url`` the PD flow
    (what tests/integrations/vllm/vllm_harness/pd_proxy.py does, without the relay): the prompt on the
    producer with one output token, then streamed from the consumer at ``url``."""
    started = time.perf_counter()
    if prefill_url is not None:
        stream(prefill_url, model, tokens, 1)
    times = stream(url, model, tokens, n)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return times[0] - started, statistics.mean(gaps) if gaps else float("nan")


def decode_stall(
    url: str, model: str, short: list[int], long: list[int], n: int, prefill_url: str | None = None
) -> float:
    """Largest gap between the tokens of ``short`` decoding on ``url`` while ``long``
    arrives (with ``prefill_url``: prefilled there, then sent to ``url``)."""
    times: list[float] = []
    worker = threading.Thread(target=stream, args=(url, model, short, n, times))
    worker.start()
    deadline = time.monotonic() + 300
    while len(times) < 4 and worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.005)  # the short request is decoding
    if prefill_url is not None:
        stream(prefill_url, model, long, 1)
    stream(url, model, long, 1)
    worker.join()
    gaps = [b - a for a, b in zip(times, times[1:])]
    return max(gaps) if gaps else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="2048,4096")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    raise_on_sigterm()
    if not VLLM_PYTHON.exists():
        print(f"needs vLLM's venv at {VLLM_PYTHON}: make setup-vllm", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",")]
    rows: list[dict[str, Any]] = []
    with workspace("bench-pd-") as (procs, work):
        print("building the model ...", file=sys.stderr, flush=True)
        model = str(build_model(work / "llama-8L-768"))
        port = free_port()
        address = f"tcp://127.0.0.1:{port}"
        procs.start(
            "daemon",
            [sys.executable, "-m", "lmcache_server", "--set", f"listen=[tcp://127.0.0.1:{port}]"]
            + ["--set", "max_local_cpu_size=4GiB", "--set", "metrics_port=0"],
        )
        plain = doc_command("vllm-replica-command-cpu").split(" \\\n  --kv-transfer-config", 1)[0] + "\n"
        commands = {
            "producer": doc_command("vllm-pd-producer-command"),
            "consumer": doc_command("vllm-pd-consumer-command"),
            "single": plain,
        }
        servers = {s["name"]: s for s in start_servers(procs, commands, Path(model), address)}
        producer, consumer = servers["producer"]["url"], servers["consumer"]["url"]
        targets = {"single": (servers["single"]["url"], None), "pd": (consumer, producer)}
        rng = random.Random(0)

        def prompt(n: int) -> list[int]:
            return [rng.randrange(3, 1024) for _ in range(n)]

        for url, prefill in targets.values():  # warm-up, not measured: first requests, store and load
            ttft_itl(url, model, prompt(600), 4, prefill)
        for size in sizes:
            for rep in range(args.reps):
                row: dict[str, Any] = {"tokens": size, "rep": rep}
                for name, (url, prefill) in targets.items():
                    before = counters(servers["consumer"])
                    row[f"{name}_ttft_s"], row[f"{name}_itl_s"] = ttft_itl(
                        url, model, prompt(size), args.tokens, prefill
                    )
                    if name == "pd":
                        after = counters(servers["consumer"])
                        row["pd_loaded_tokens"] = after.get("loaded_tokens", 0) - before.get("loaded_tokens", 0)
                        row["pd_load_s"] = after.get("load_s", 0) - before.get("load_s", 0)
                    row[f"{name}_stall_s"] = decode_stall(
                        url, model, prompt(128), prompt(size), args.tokens * 4, prefill
                    )
                rows.append(row)
                print(
                    f"{size} tokens rep {rep}: TTFT single {row['single_ttft_s']:.2f}s pd {row['pd_ttft_s']:.2f}s; "
                    f"ITL single {row['single_itl_s'] * 1000:.1f}ms pd {row['pd_itl_s'] * 1000:.1f}ms; "
                    f"decode stall single {row['single_stall_s']:.2f}s pd {row['pd_stall_s']:.2f}s; "
                    f"consumer loaded {row['pd_loaded_tokens']:.0f} tokens in {row['pd_load_s'] * 1000:.0f} ms",
                    flush=True,
                )
    print(f"\nmedians of {args.reps}; ratios PD / single")
    print(
        f"{'tokens':>6} {'TTFT 1':>8} {'TTFT PD':>8} {'ratio':>6} {'ITL 1':>8} {'ITL PD':>8} {'ratio':>6} "
        f"{'stall 1':>8} {'stall PD':>8} {'ratio':>6}"
    )
    for size in sizes:
        mine = [r for r in rows if r["tokens"] == size]

        def med(key: str, mine: list[dict[str, Any]] = mine) -> float:
            return statistics.median(r[key] for r in mine)

        print(
            f"{size:>6} {med('single_ttft_s'):>7.2f}s {med('pd_ttft_s'):>7.2f}s "
            f"{med('pd_ttft_s') / med('single_ttft_s'):>6.2f} "
            f"{med('single_itl_s') * 1000:>6.1f}ms {med('pd_itl_s') * 1000:>6.1f}ms "
            f"{med('pd_itl_s') / med('single_itl_s'):>6.2f} "
            f"{med('single_stall_s'):>7.2f}s {med('pd_stall_s'):>7.2f}s "
            f"{med('pd_stall_s') / med('single_stall_s'):>6.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
