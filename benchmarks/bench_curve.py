"""What CURVE costs: daemon throughput with ``auth: none`` and with ``auth: curve``.

Two daemons run at once on loopback tcp (same pool size, payload frames, no
shared memory); one sync client each moves batches of 8 chunks, put (fresh
keys every request) and get (the same 8 keys again and again).  The two are
measured back to back, repetitions interleaved, so outside load hits both
alike; the table shows the median MiB/s and curve/none.

CURVE encrypts every frame in libzmq's I/O thread (XSalsa20-Poly1305), on
both sides, so its cost grows with the bytes moved.

    .venv/bin/python benchmarks/bench_curve.py [--sizes 1,4,16] [--reps 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from lmcache_client import CacheClient, DaemonUnavailable, PutStatus
from lmcache_client.curve import write_keypair
from lmcache_client.memtune import tune_malloc

MIB = 1 << 20
BATCH = 8
NS = "bench|float16|L32|KV8|D128|tp0of1|c256"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_daemon(folder: Path, name: str, extra: dict[str, Any], pool: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    config = {"listen": [address], "metrics_port": 0, "max_local_cpu_size": pool, "shared_memory": False, **extra}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    log = open(folder / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the child
    proc = subprocess.Popen([sys.executable, "-m", "lmcache_server", "--config", str(path)], stdout=log, stderr=log,
                            env=env)  # fmt: skip
    return proc, address


def wait_ready(client: CacheClient, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}")
        try:
            client.ping(timeout_s=0.5)
            return
        except DaemonUnavailable:
            time.sleep(0.1)
    raise TimeoutError("daemon not ready")


def rate(run: Callable[[], None], calls: int, size: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        run()
    return calls * BATCH * size / MIB / (time.perf_counter() - started)


def put_run(client: CacheClient, payloads: list[bytes]) -> Callable[[], None]:
    def run() -> None:  # fresh keys: a put of a stored key is a no-op
        statuses = client.put([os.urandom(32) for _ in range(BATCH)], payloads)
        assert all(s == PutStatus.STORED for s in statuses), statuses

    return run


def get_run(client: CacheClient, payloads: list[bytes]) -> Callable[[], None]:
    keys = [os.urandom(32) for _ in range(BATCH)]
    client.put(keys, payloads)

    def run() -> None:
        assert all(b is not None for b in client.get(keys))

    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--sizes", default="1,4,16", help="chunk sizes in MiB (default 1,4,16)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per cell (default 7)")
    p.add_argument("--rep-mib", type=int, default=256, help="MiB per repetition (default 256)")
    p.add_argument("--pool-size", default="1GiB")
    p.add_argument("--json", type=Path, metavar="PATH")
    args = p.parse_args()
    tune_malloc()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-curve-") as tmp:
        folder = Path(tmp)
        server_public, server_secret = write_keypair(folder, "server")
        _, client_secret = write_keypair(folder, "client")
        (folder / "clients.yaml").write_text(
            yaml.safe_dump({"clients": {"bench": {"public_key": str(folder / "client.key"), "admin": True}}})
        )
        curve = {"auth": "curve", "server_secret_key_file": str(server_secret),
                 "client_keys_file": str(folder / "clients.yaml")}  # fmt: skip
        procs: list[subprocess.Popen[bytes]] = []
        try:
            clients: dict[str, CacheClient] = {}
            for name, extra in (("none", {}), ("curve", curve)):
                proc, address = start_daemon(folder, name, extra, args.pool_size)
                procs.append(proc)
                secure = name == "curve"
                clients[name] = CacheClient(
                    address,
                    NS,
                    timeout_s=60,
                    fail_open=False,
                    shared_memory=False,
                    server_public_key=str(server_public) if secure else None,
                    client_secret_key=str(client_secret) if secure else None,
                )
                wait_ready(clients[name], proc)
            for size_mib in (int(s) for s in args.sizes.split(",")):
                size = size_mib * MIB
                payloads = [os.urandom(size) for _ in range(BATCH)]
                calls = max(1, args.rep_mib // (BATCH * size_mib))
                for op in ("put", "get"):
                    runs: dict[str, Callable[[], None]] = {}
                    for name, client in clients.items():
                        run = put_run(client, payloads) if op == "put" else get_run(client, payloads)
                        run()  # warm-up
                        runs[name] = run
                    samples: dict[str, list[float]] = {name: [] for name in runs}
                    for _ in range(args.reps):
                        for name, run in runs.items():
                            samples[name].append(rate(run, calls, size))
                    none, curve_rate = (statistics.median(samples[n]) for n in ("none", "curve"))
                    row = {"op": op, "size_mib": size_mib, "none_mib_s": round(none), "curve_mib_s": round(curve_rate),
                           "ratio": round(curve_rate / none, 2)}  # fmt: skip
                    rows.append(row)
                    print(f"{op:3} {size_mib:3} MiB  none {none:8,.0f}  curve {curve_rate:8,.0f} MiB/s  "
                          f"curve/none {curve_rate / none:.2f}", flush=True)  # fmt: skip
            for client in clients.values():
                client.close()
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
