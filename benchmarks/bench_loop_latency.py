"""Event-loop stalls from big puts: p99 of 64-key lookups while another client
streams 8 x 32 MiB puts, with the disk tier and the Redis uplink on (issue #14 item 6).

One run measures two daemons, one after the other, on the same machine:

- ``before``: the code of ``--before REV`` (default: the last commit whose put
  copy into the pool, Redis record copy and checksum ran on the event loop),
  checked out into a temporary git worktree and run from there;
- ``after``: this checkout.

For each: p50 / p99 / max of a 64-key lookup (keys pinned in memory, so the
lookup itself never leaves the daemon) first with no other load (``idle``),
then while a second client process streams ``--puts`` puts of ``--batch`` x
``--chunk-mib`` MiB to a *second daemon* of the same code (``floor``: the same
work on the machine, none of it on the measured daemon's event loop, so what
the CPUs alone cost the lookups), then while it streams them to the measured
daemon itself (``load``).  ``load`` above ``floor`` is what the daemon's own
event loop adds.  Every daemon gets the same config: a 1 GiB pool, a disk tier
in a temp dir, a redis-server on a free port (maxmemory 512 MiB,
allkeys-lru).  Target: p99 under load <= 5 ms on 2 cores.

    python benchmarks/bench_loop_latency.py [--before REV|none] [--puts 16] [--json out.json]

Run it alone: other work on the machine is noise in a latency tail.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import MIB, Processes, free_port, raise_on_sigterm, wait_until  # noqa: E402

from lmcache_client import CacheClient, DaemonUnavailable, PutStatus  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "bench-loop|bfloat16|L32|KV8|D128|tp0of1|c256"
BEFORE = "1e6c3d2"
"""The last commit before the copies and checksums moved off the event loop (e7e481c)."""
LOOKUP_KEYS = 64
PAUSE_S = 0.002  # between lookups: a sample every few ms, not a busy loop competing for the 2 cores


def _pingable(c: CacheClient) -> bool:
    try:
        c.ping(timeout_s=0.5)
        return True
    except DaemonUnavailable:
        return False


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "n": len(samples),
        "p50_ms": round(statistics.median(samples) * 1e3, 3),
        "p99_ms": round(percentile(samples, 0.99) * 1e3, 3),
        "max_ms": round(max(samples) * 1e3, 3),
    }


def put_load_main(address: str, puts: int, batch: int, chunk_bytes: int) -> int:
    """The streaming client (its own process: it must not share the lookup client's GIL)."""
    payload = os.urandom(chunk_bytes)
    with CacheClient(address, NAMESPACE, timeout_s=120, fail_open=False, shared_memory=False) as c:
        c.ping()
        # Started and connected: the measurement begins after this, not during our start-up.
        print("ready", flush=True)
        sys.stdin.readline()
        started = time.perf_counter()
        stored = 0
        for _ in range(puts):
            statuses = c.put([os.urandom(32) for _ in range(batch)], [payload] * batch)
            stored += sum(s is PutStatus.STORED for s in statuses)
        elapsed = time.perf_counter() - started
    print(json.dumps({"stored": stored, "mib_per_s": round(puts * batch * chunk_bytes / MIB / elapsed, 1)}))
    return 0


def lookups_until(c: CacheClient, keys: list[bytes], done: Any, minimum: int) -> list[float]:
    samples: list[float] = []
    while len(samples) < minimum or not done():
        started = time.perf_counter()
        result = c.lookup(keys)
        samples.append(time.perf_counter() - started)
        assert result.hit_chunks == len(keys), result
        time.sleep(PAUSE_S)
    return samples


def measure(name: str, root: Path, args: argparse.Namespace, base: Path) -> dict[str, Any]:
    workdir = base / name
    workdir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(root)}
    procs = Processes(workdir, env)
    try:
        redis_port = free_port()
        redis = procs.start("redis", [
            "redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(workdir), "--maxmemory", "512mb", "--maxmemory-policy", "allkeys-lru",
        ])  # fmt: skip

        def start_daemon(label: str) -> tuple[str, Any]:
            address = f"tcp://127.0.0.1:{free_port()}"
            child = procs.start(label, [
                sys.executable, "-m", "lmcache_server", "--listen", address, "--metrics-port", "0",
                "--max-local-cpu-size", "1GiB",
                "--set", f"local_disk=file://{workdir / label}", "--set", "max_local_disk_size=2GiB",
                "--set", f"remote_url=redis://127.0.0.1:{redis_port}",
                "--set", "shared_memory=false", "--set", "stats_log_interval_s=0",
            ], cwd=root)  # fmt: skip
            with CacheClient(address, NAMESPACE, timeout_s=30, fail_open=False, shared_memory=False) as probe:
                wait_until(lambda: _pingable(probe), 60, f"{label} ({name})", child.check_alive)
            return address, child

        address, daemon = start_daemon("daemon")
        other, _ = start_daemon("other-daemon")
        with CacheClient(address, NAMESPACE, timeout_s=30, fail_open=False, shared_memory=False) as c:
            redis.check_alive()
            assert c.stats()["tiers"]["redis"]["up"], "the Redis uplink is not up"
            keys = [os.urandom(32) for _ in range(LOOKUP_KEYS)]
            assert c.put(keys, [os.urandom(16 * 1024)] * LOOKUP_KEYS) == [PutStatus.STORED] * LOOKUP_KEYS
            assert all(c.pin(keys)), "could not pin the lookup keys"
            idle = lookups_until(c, keys, lambda: True, args.idle_lookups)

            def under_puts_to(target: str) -> tuple[list[float], dict[str, Any]]:
                loader = subprocess.Popen(
                    [sys.executable, __file__, "put-load", target, str(args.puts), str(args.batch),
                     str(args.chunk_mib * MIB)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                )  # fmt: skip
                assert loader.stdin is not None and loader.stdout is not None
                assert loader.stdout.readline().strip() == "ready", "the put load did not start"
                loader.stdin.write("go\n")
                loader.stdin.flush()
                samples = lookups_until(c, keys, lambda: loader.poll() is not None, 50)
                out, _ = loader.communicate()
                assert loader.returncode == 0, f"put load failed ({loader.returncode})"
                return samples, json.loads(out.strip().splitlines()[-1])

            floor, _ = under_puts_to(other)
            load, stream = under_puts_to(address)
            tiers = c.stats()["tiers"]
        daemon.check_alive()
        return {
            "daemon": name,
            "root": str(root),
            "idle": summary(idle),
            "floor": summary(floor),
            "load": summary(load),
            "put_mib_per_s": stream["mib_per_s"],
            "put_chunks_stored": stream["stored"],
            "disk_spills": tiers["disk"]["spills"],
            "disk_spills_lent": tiers["disk"].get("spills_lent", 0),
            "disk_spills_dropped": tiers["disk"]["spills_dropped"],
            "redis_stores": tiers["redis"]["stores"],
            "redis_dropped": tiers["redis"]["dropped_writes"],
        }
    finally:
        procs.stop_all()


def checkout(rev: str, base: Path) -> Path:
    tree = base / f"tree-{rev}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
    return tree


def main(argv: list[str]) -> int:
    if argv[:1] == ["put-load"]:
        return put_load_main(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default=BEFORE, help=f"git revision of 'before' (default {BEFORE}); 'none' skips it")
    p.add_argument("--puts", type=int, default=16, help="puts streamed under load (default 16)")
    p.add_argument("--batch", type=int, default=8, help="chunks per put (default 8)")
    p.add_argument("--chunk-mib", type=int, default=32, help="MiB per chunk (default 32)")
    p.add_argument("--idle-lookups", type=int, default=500, help="lookups of the idle baseline (default 500)")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = p.parse_args(argv)
    raise_on_sigterm()
    base = Path(tempfile.mkdtemp(prefix="lmcache-bench-loop-"))
    rows: list[dict[str, Any]] = []
    tree: Path | None = None
    try:
        if args.before != "none":
            tree = checkout(args.before, base)
            rows.append(measure(f"before ({args.before})", tree, args, base))
        rows.append(measure("after (this checkout)", REPO, args, base))
    finally:
        if tree is not None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(base, ignore_errors=True)
    print(f"64-key lookups, ms; load = {args.puts} puts of {args.batch} x {args.chunk_mib} MiB from another "
          f"process, disk and Redis on; {os.cpu_count()} CPUs")  # fmt: skip
    print(f"  {'daemon':<24} {'idle p50':>8} {'idle p99':>8} {'floor p99':>9} {'load p50':>8} {'load p99':>8}"
          f" {'load max':>8} {'put MiB/s':>9}")  # fmt: skip
    for r in rows:
        print(f"  {r['daemon']:<24} {r['idle']['p50_ms']:>8.2f} {r['idle']['p99_ms']:>8.2f} "
              f"{r['floor']['p99_ms']:>9.2f} {r['load']['p50_ms']:>8.2f} {r['load']['p99_ms']:>8.2f} "
              f"{r['load']['max_ms']:>8.2f} {r['put_mib_per_s']:>9.0f}")  # fmt: skip
    after = rows[-1]
    print(f"  after: load p99 / idle p99 = {after['load']['p99_ms'] / after['idle']['p99_ms']:.2f}, "
          f"load p99 - floor p99 = {after['load']['p99_ms'] - after['floor']['p99_ms']:.2f} ms; "
          f"target load p99 <= 5 ms: {'met' if after['load']['p99_ms'] <= 5 else 'NOT met'}")  # fmt: skip
    if len(rows) == 2:
        print(f"  load p99 before / after = {rows[0]['load']['p99_ms'] / after['load']['p99_ms']:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
