"""Soak test: several client processes put and get with eviction churn for a bounded time.

Starts ``python -m lmcache_server`` on a free loopback port (memory pool
``--pool-mib``, default 256 MiB, metrics off), then ``--clients`` processes
(default 4) that for ``--duration-s`` seconds (default 60) put fresh chunks of
256 KiB..4 MiB (so the pool churns: everything is evicted many times over) and
get earlier ones back, checking every hit byte for byte (a chunk's bytes are
its key repeated, so another chunk's bytes never pass).  Clients use
``fail_open=False``, so a timeout is an error, not a silent miss.  Even-numbered
clients map the daemon's pool (the shared-memory path, leases and all), odd
ones send payload frames, so both data paths churn the same pool at once.

Reports ops, errors (must be 0: DaemonUnavailable, ServerError, wrong bytes),
p50/p99 latency, hits/misses, and the daemon's RSS sampled every second from
/proc/PID/status, which must stay within the pool plus ``--overhead-mib``
(default 150: interpreter, libraries and receive buffers).  Prints PASS or
MISS and exits 1 on MISS or any error.

    .venv/bin/python benchmarks/soak.py --duration-s 60 --json soak.json

``--json PATH`` writes {"ops", "errors", "p50_ms", "p99_ms", "rss_mib_max", "pool_mib"}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import multiprocessing as mp
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lmcache_client import CacheClient, DaemonUnavailable, ServerError

NAMESPACE = "soak-model|float16|L2|KV2|D64|tp0of1|c16"
KIB = 1024
MIB = 1024 * KIB


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chunk_bytes(key: bytes, size: int) -> bytes:
    """The payload of ``key``: the key repeated to ``size`` bytes (cheap to make and to check)."""
    return (key * (size // len(key) + 1))[:size]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def worker(
    index: int, address: str, deadline: float, min_kib: int, max_kib: int, results: mp.Queue[dict[str, Any]]
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    rng = random.Random(1000 + index)
    latencies: list[float] = []
    errors: list[str] = []
    counts = {"puts": 0, "gets": 0, "hits": 0, "misses": 0, "not_stored": 0}
    written: list[tuple[bytes, int]] = []
    with CacheClient(address, NAMESPACE, timeout_s=10.0, fail_open=False, shared_memory=index % 2 == 0) as c:
        counts["shm"] = int(c.uses_shared_memory)
        n = 0
        while time.monotonic() < deadline:
            if not written or rng.random() < 0.45:
                key = hashlib.sha256(f"soak-{index}-{n}".encode()).digest()
                n += 1
                size = rng.randint(min_kib, max_kib) * KIB
                data = chunk_bytes(key, size)
                t0 = time.perf_counter()
                try:
                    statuses = c.put([key], [data])
                except (DaemonUnavailable, ServerError) as err:
                    errors.append(f"put: {type(err).__name__}: {err}")
                    continue
                latencies.append(time.perf_counter() - t0)
                counts["puts"] += 1
                if statuses[0] in (0, 1):  # STORED, EXISTS
                    written.append((key, size))
                else:
                    counts["not_stored"] += 1
            else:
                # Mostly recent keys (likely hits), sometimes old ones (likely evicted).
                pick = len(written) - 1 - min(int(rng.expovariate(1 / 20)), len(written) - 1)
                key, size = written[pick]
                t0 = time.perf_counter()
                try:
                    got = c.get([key])[0]
                except (DaemonUnavailable, ServerError) as err:
                    errors.append(f"get: {type(err).__name__}: {err}")
                    continue
                if got is None:
                    counts["misses"] += 1
                elif bytes(got) != chunk_bytes(key, size):
                    errors.append(f"get: wrong bytes for key {key.hex()}")
                else:
                    counts["hits"] += 1
                latencies.append(time.perf_counter() - t0)
                counts["gets"] += 1
    results.put({"latencies": latencies, "errors": errors, **counts})


def start_daemon(address: str, pool_mib: int, log: Any) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    cmd = [sys.executable, "-m", "lmcache_server", "--listen", address, "--metrics-port", "0",
           "--max-local-cpu-size", f"{pool_mib}MiB", "--set", "stats_log_interval_s=0"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 30
    quiet = logging.getLogger("lmcache_client.client")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # "unavailable" while the daemon is still starting is expected
    try:
        with CacheClient(address, timeout_s=0.5, fail_open=False) as probe:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(f"daemon exited with {proc.returncode}")
                try:
                    probe.ping(timeout_s=0.5)
                    return proc
                except DaemonUnavailable:
                    time.sleep(0.05)
    finally:
        quiet.setLevel(level)
    raise RuntimeError("daemon did not answer within 30 s")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--pool-mib", type=int, default=256)
    ap.add_argument("--overhead-mib", type=float, default=150.0)
    ap.add_argument("--min-kib", type=int, default=256)
    ap.add_argument("--max-kib", type=int, default=4096)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    address = f"tcp://127.0.0.1:{free_port()}"
    workdir = Path(tempfile.mkdtemp(prefix="lmcache-soak-"))
    log = open(workdir / "daemon.log", "ab")  # noqa: SIM115 - closed in finally
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    daemon: subprocess.Popen[bytes] | None = None
    samples: list[tuple[float, float]] = []
    try:
        daemon = start_daemon(address, args.pool_mib, log)
        print(f"daemon pid {daemon.pid} on {address}, pool {args.pool_mib} MiB, log {workdir / 'daemon.log'}")
        results: mp.Queue[dict[str, Any]] = ctx.Queue()
        start = time.monotonic()
        deadline = start + args.duration_s
        for i in range(args.clients):
            p = ctx.Process(target=worker, args=(i, address, deadline, args.min_kib, args.max_kib, results))
            p.start()
            procs.append(p)
        next_print = start
        while time.monotonic() < deadline:
            if daemon.poll() is not None:
                raise RuntimeError(f"daemon died with {daemon.returncode}")
            now = time.monotonic()
            samples.append((now - start, rss_mib(daemon.pid)))
            if now >= next_print:
                print(f"  t={now - start:5.1f}s  daemon RSS {samples[-1][1]:7.1f} MiB", flush=True)
                next_print += max(5.0, args.duration_s / 6)
            time.sleep(1.0)
        samples.append((time.monotonic() - start, rss_mib(daemon.pid)))
        outs = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
        elapsed = time.monotonic() - start
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        if daemon is not None and daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(5)
        log.close()

    latencies = [x for o in outs for x in o["latencies"]]
    errors = [e for o in outs for e in o["errors"]]
    total = {k: sum(o[k] for o in outs) for k in ("puts", "gets", "hits", "misses", "not_stored", "shm")}
    ops = total["puts"] + total["gets"]
    p50, p99 = percentile(latencies, 0.50) * 1000, percentile(latencies, 0.99) * 1000
    rss_max = max(r for _, r in samples)
    limit = args.pool_mib + args.overhead_mib
    print(f"{ops} ops in {elapsed:.1f}s ({ops / elapsed:.0f}/s): {total['puts']} puts "
          f"({total['not_stored']} not stored), {total['gets']} gets "
          f"({total['hits']} hits, {total['misses']} misses); {total['shm']} of {len(outs)} clients "
          "on shared memory, the rest on payload frames")  # fmt: skip
    print(f"latency p50 {p50:.2f} ms, p99 {p99:.2f} ms, mean {statistics.fmean(latencies) * 1000:.2f} ms")
    print(f"errors: {len(errors)}")
    for e in errors[:10]:
        print(f"  {e}")
    rss_ok = rss_max <= limit
    print(f"daemon RSS max {rss_max:.1f} MiB, limit pool {args.pool_mib} + overhead {args.overhead_mib:.0f} "
          f"= {limit:.0f} MiB: {'PASS' if rss_ok else 'MISS'}")  # fmt: skip
    print("PASS" if rss_ok and not errors else "MISS")
    if args.json is not None:
        row = {"ops": ops, "errors": len(errors), "p50_ms": round(p50, 3), "p99_ms": round(p99, 3),
               "rss_mib_max": round(rss_max, 1), "pool_mib": float(args.pool_mib)}  # fmt: skip
        args.json.write_text(json.dumps(row) + "\n")
    return 0 if rss_ok and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
