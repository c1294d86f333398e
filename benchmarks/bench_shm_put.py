"""Shared-memory puts: staged slots (one ``bind`` per put) against alloc+commit (two round trips).

One daemon (``python -m lmcache_server``, a 1 GiB pool by default, ipc) and
two sync clients on it, one with ``staged_puts=True`` (the default) and one
with ``staged_puts=False``.  Each pool is filled first (untimed), so puts
run in the steady state of a full cache (every put evicts).  Then, per
(chunk size, chunks per put), blocks of ``--block`` puts under fresh keys
alternate between the two clients for ``--rounds`` rounds, with a memcpy
block (the same bytes into one preallocated buffer) after each round; the
figures are medians over the rounds, so drift and outside load hit both
paths alike.  Requests per put are counted on the client side (every request
the client sends, by op).

Usage: ``flock /tmp/lmcache-bench.lock .venv/bin/python benchmarks/bench_shm_put.py``
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from lmcache_client import CacheClient

MIB = 1 << 20


def _counting(client: CacheClient, counts: collections.Counter[str]) -> None:
    """Count every request ``client`` sends (answered or told), by op."""
    run, tell = client._conn.run, client._conn.tell

    def counted_run(call: Any, timeout_s: float | None = None) -> Any:
        counts[call.op.value] += 1
        return run(call, timeout_s)

    def counted_tell(call: Any) -> None:
        counts[call.op.value] += 1
        tell(call)

    client._conn.run = counted_run  # type: ignore[method-assign]
    client._conn.tell = counted_tell  # type: ignore[method-assign]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--sizes", default="1,4", help="chunk sizes in MiB (default 1,4)")
    p.add_argument("--chunks", default="1,8", help="chunks per put (default 1,8)")
    p.add_argument("--rounds", type=int, default=15, help="alternating rounds (default 15)")
    p.add_argument("--block", type=int, default=20, help="puts per client per round (default 20)")
    p.add_argument("--pool-size", default="1GiB", help="the daemon's pool (default 1GiB)")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lmcache-shmput-"))
    shm_dir = Path(tempfile.mkdtemp(prefix="lmcache-shmput-", dir="/dev/shm"))
    address = f"ipc://{work}/daemon.sock"
    config = {"listen": [address], "max_local_cpu_size": a.pool_size, "shm_dir": str(shm_dir), "metrics_port": 0}
    config["warm_restart"] = False
    (work / "server.yaml").write_text(yaml.safe_dump(config))
    with open(work / "daemon.log", "wb") as log:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "lmcache_server", "--config", str(work / "server.yaml")],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        clients = {staged: CacheClient(address, "bench", timeout_s=60, fail_open=False, staged_puts=staged)
                   for staged in (True, False)}  # fmt: skip
        deadline = time.monotonic() + 30
        while not all(c.uses_shared_memory for c in clients.values()):
            if time.monotonic() > deadline or daemon.poll() is not None:
                raise SystemExit(f"the daemon did not offer its pool:\n{(work / 'daemon.log').read_text()}")
            time.sleep(0.1)
        counts = {staged: collections.Counter[str]() for staged in clients}
        for staged, c in clients.items():
            _counting(c, counts[staged])
        serial = iter(range(1 << 62))

        def fresh(n: int) -> list[bytes]:
            return [hashlib.sha256(b"%d" % next(serial)).digest() for _ in range(n)]

        pool_mib = clients[True].stats()["tiers"]["memory"]["capacity_bytes"] // MIB
        print(f"pool {pool_mib} MiB, {a.rounds} rounds x {a.block} puts per client, medians; ipc, same host")
        for size_mib in (int(s) for s in a.sizes.split(",")):
            for chunks in (int(n) for n in a.chunks.split(",")):
                src = [os.urandom(size_mib * MIB) for _ in range(chunks)]
                dst = bytearray(size_mib * MIB)
                for c in clients.values():  # steady state: a full pool, every put evicts
                    for _ in range(pool_mib // (size_mib * chunks) + 2):
                        c.put(fresh(chunks), src)
                for counter in counts.values():
                    counter.clear()
                per: dict[bool, list[float]] = {True: [], False: []}
                copy: list[float] = []
                for _ in range(a.rounds):
                    for staged, c in clients.items():
                        t0 = time.perf_counter()
                        for _ in range(a.block):
                            c.put(fresh(chunks), src)
                        per[staged].append((time.perf_counter() - t0) / a.block)
                    t0 = time.perf_counter()
                    for _ in range(a.block):
                        for s in src:
                            dst[:] = s
                    copy.append((time.perf_counter() - t0) / a.block)
                staged_s, alloc_s, copy_s = (statistics.median(v) for v in (per[True], per[False], copy))
                puts = a.rounds * a.block
                mib = size_mib * chunks
                asked = {s: ", ".join(f"{op} {n / puts:.2f}" for op, n in sorted(counts[s].items())) for s in counts}
                print(
                    f"{chunks} x {size_mib} MiB per put: staged {staged_s * 1e3:.2f} ms = {mib / staged_s:,.0f} MiB/s "
                    f"({copy_s / staged_s:.2f}x memcpy), alloc+commit {alloc_s * 1e3:.2f} ms = "
                    f"{mib / alloc_s:,.0f} MiB/s ({copy_s / alloc_s:.2f}x memcpy); "
                    f"staged/alloc {alloc_s / staged_s:.2f}x"
                )
                print(f"    requests per put: staged [{asked[True]}], alloc+commit [{asked[False]}]")
        for c in clients.values():
            c.close()
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
        for d in (shm_dir, work):
            subprocess.run(["rm", "-rf", str(d)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
