"""Warm restart: how long the memory tier is gone across a daemon restart.

Three runs, each a fresh daemon on its own shared-memory directory, its pool
filled with ``--chunk-mib`` chunks (prompts of ``--chunks-per-prompt`` chunks,
a hash chain each) until full:

- **no restart**: the 100 requests run on the daemon that was filled;
- **warm restart**: SIGTERM, then (as systemd or compose would, once it has
  exited) a new daemon with the same config; a client polls ``get`` of a
  stored chunk from the moment of the SIGTERM, and the time to its first hit
  with the right bytes is the figure (target <= 3 s); then the 100 requests;
- **cold restart** (``warm_restart: false``): the same, for comparison.

A request looks up its prompt's keys (the leading hits are its cached tokens),
reads the hit chunks (checking the key stamped into each), and stores the
chunks it missed, as an engine does; a quarter of the prompts were never
stored.  Same seed, same requests in every run, so the token hit rates must be
equal between "no restart" and "warm restart".

Run: ``python benchmarks/bench_restart.py [--pool-size 4GiB] [--chunk-mib 16]``.
The pool lives in /dev/shm: it needs ``--pool-size`` free there (df -h /dev/shm).
"""

from __future__ import annotations

import argparse
import logging
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Child, Processes, free_port, raise_on_sigterm, workspace  # noqa: E402
from _harness import start_daemon as harness_start_daemon  # noqa: E402

from lmcache_client import CacheClient  # noqa: E402
from lmcache_client.keys import chunk_keys  # noqa: E402

NAMESPACE = "bench-restart|bfloat16|L32|KV8|D128|tp0of1|c256"
CHUNK_TOKENS = 256


def parse_size(text: str) -> int:
    units = {"gib": 1 << 30, "mib": 1 << 20, "g": 1 << 30, "m": 1 << 20}
    for unit, factor in units.items():
        if text.lower().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


class Workload:
    """Prompts (chains of chunk keys) and the payload of each key (a shared block
    with the key stamped into its first 32 bytes: checkable, no GiBs of buffers)."""

    def __init__(self, pool_bytes: int, chunk_bytes: int, per_prompt: int, requests: int, seed: int = 19):
        rng = random.Random(seed)
        self.block = bytearray(rng.randbytes(chunk_bytes))
        stored_prompts = pool_bytes // chunk_bytes // per_prompt
        unseen = max(1, stored_prompts // 3)
        self.prompts = [
            chunk_keys([rng.randrange(32000) for _ in range(per_prompt * CHUNK_TOKENS)], CHUNK_TOKENS)
            for _ in range(stored_prompts + unseen)
        ]
        self.stored = self.prompts[:stored_prompts]
        self.requests = [rng.randrange(len(self.prompts)) for _ in range(requests)]

    def payload(self, key: bytes) -> bytearray:
        self.block[:32] = key
        return self.block


def start_daemon(procs: Processes, name: str, port: int, shm_dir: Path, pool: int, warm: bool, policy: str) -> Child:
    settings: dict[str, object] = {
        "max_local_cpu_size": f"{pool}B",
        "shm_dir": str(shm_dir),
        "warm_restart": "true" if warm else "false",
        "cache_policy": policy,
        "stats_log_interval_s": 0,
        "max_inflight_bytes": "4GiB",
    }
    return harness_start_daemon(procs, name, port, settings)


def fill(address: str, w: Workload) -> int:
    stored = 0
    with CacheClient(address, NAMESPACE, timeout_s=30.0, fail_open=False) as c:
        for prompt in w.stored:
            for k in prompt:
                stored += c.put([k], [w.payload(k)]) == [0]
    return stored


def run_requests(address: str, w: Workload) -> tuple[float, int]:
    """Token hit rate of the requests, and wrong chunks read (must be 0)."""
    hit_tokens = total_tokens = wrong = 0
    with CacheClient(address, NAMESPACE, timeout_s=30.0, fail_open=False) as c:
        for i in w.requests:
            keys = w.prompts[i]
            hits = c.lookup(keys).hit_chunks
            got = c.get(keys[:hits]) if hits else []
            wrong += sum(g is None or bytes(g[:32]) != k or len(g) != len(w.block) for g, k in zip(got, keys))
            for k in keys[hits:]:
                c.put([k], [w.payload(k)])
            hit_tokens += hits * CHUNK_TOKENS
            total_tokens += len(keys) * CHUNK_TOKENS
    return hit_tokens / total_tokens, wrong


def restart(procs: Processes, old: Child, port: int, shm_dir: Path, pool: int, warm: bool, policy: str, w: Workload):  # type: ignore[no-untyped-def]
    """SIGTERM ``old``, start its successor; seconds from the SIGTERM to the first hit (None: none in 30 s)."""
    probe_key = w.stored[0][0]
    first_hit: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with CacheClient(f"tcp://127.0.0.1:{port}", NAMESPACE, timeout_s=0.2, backoff_s=0.0, probe_timeout_s=0.1) as c:
            while not stop.is_set():
                try:
                    got = c.get([probe_key])[0]
                except Exception:  # noqa: BLE001 - down or draining: keep polling
                    got = None
                if got is not None and bytes(got[:32]) == probe_key:
                    first_hit.append(time.perf_counter())
                    return
                time.sleep(0.005)

    poller = threading.Thread(target=poll, daemon=True)
    t0 = time.perf_counter()
    old.proc.send_signal(signal.SIGTERM)
    poller.start()
    old.proc.wait(60)
    stopped = time.perf_counter() - t0
    new = start_daemon(procs, f"{old.name}-next", port, shm_dir, pool, warm, policy)
    started = time.perf_counter() - t0
    poller.join(30 if warm else 2)  # a cold pool never has the chunk
    stop.set()
    hit = first_hit[0] - t0 if first_hit else None
    return new, stopped, started, hit


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool-size", default="4GiB", help="memory pool size (default 4GiB)")
    p.add_argument("--chunk-mib", type=int, default=16, help="chunk size in MiB (default 16)")
    p.add_argument("--chunks-per-prompt", type=int, default=4)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--policy", default="lru", help="cache_policy of the daemons (default lru)")
    args = p.parse_args()
    raise_on_sigterm()
    logging.getLogger("lmcache_client").setLevel(logging.ERROR)  # the poller's outage lines
    pool = parse_size(args.pool_size)
    chunk = args.chunk_mib << 20
    w = Workload(pool, chunk, args.chunks_per_prompt, args.requests)
    free = shutil.disk_usage("/dev/shm").free
    if free < pool + (64 << 20):
        print(f"/dev/shm has {free >> 20} MiB free, the pool needs {pool >> 20} MiB", file=sys.stderr)
        return 2
    print(
        f"pool {pool >> 20} MiB, {chunk >> 20} MiB chunks, {len(w.stored)} stored prompts of "
        f"{args.chunks_per_prompt} chunks, {len(w.prompts) - len(w.stored)} unseen, {args.requests} requests, "
        f"policy {args.policy}"
    )
    results: dict[str, tuple[float, int]] = {}
    with workspace("bench-restart-") as (procs, _):
        for run in ("no restart", "warm restart", "cold restart"):
            shm_dir = Path(tempfile.mkdtemp(prefix="bench-restart-", dir="/dev/shm"))
            try:
                port = free_port()
                warm = run != "cold restart"
                name = run.replace(" ", "-")
                daemon = start_daemon(procs, name, port, shm_dir, pool, warm, args.policy)
                started = time.perf_counter()
                stored = fill(f"tcp://127.0.0.1:{port}", w)
                filled_s = time.perf_counter() - started
                line = f"{run:>12}: filled {stored} chunks in {filled_s:.1f}s"
                if run == "no restart":  # the restart runs' first-hit probe reads this chunk: so does this one
                    with CacheClient(f"tcp://127.0.0.1:{port}", NAMESPACE, timeout_s=30.0) as c:
                        c.get([w.stored[0][0]])
                if run != "no restart":
                    daemon, stopped, up, hit = restart(procs, daemon, port, shm_dir, pool, warm, args.policy, w)
                    first = f"{hit:.2f}s" if hit is not None else "none (memory empty)"
                    line += f"; SIGTERM -> old exited {stopped:.2f}s, new answering {up:.2f}s, first hit {first}"
                results[run] = run_requests(f"tcp://127.0.0.1:{port}", w)
                print(
                    f"{line}; token hit rate of the {args.requests} requests {results[run][0]:.3f}, "
                    f"wrong chunks {results[run][1]}",
                    flush=True,
                )
                procs.stop(daemon)
            finally:
                shutil.rmtree(shm_dir, ignore_errors=True)
    base, warm_rate, cold_rate = (results[r][0] for r in ("no restart", "warm restart", "cold restart"))
    print(f"hit rate warm/no-restart = {warm_rate / base:.3f} (target 1.000); cold/no-restart = {cold_rate / base:.3f}")
    return 0 if all(r[1] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
