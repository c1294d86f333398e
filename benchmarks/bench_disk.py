"""Disk tier throughput through the daemon vs fio in the same directory, and index rebuild time.

Write: puts of 4 and 16 MiB chunks into a daemon whose memory tier holds only
a few of them, so every put evicts one chunk that spills to the disk tier;
throughput = bytes that reached the disk / time from the first put until the
spill queue is empty (the queue is sized to hold the whole run: nothing is
dropped).  Read: gets of chunks that are only on disk (each one read,
checksummed, promoted into memory and sent), through the real socket.

Baseline, in the same run and the same directory: fio sequential write and read
of files of the same size (one file per chunk, block size = chunk size, psync,
buffered like the daemon's ``disk_fsync: none``).  Both read paths see the
same page cache state: files written moments before, read back once (the
script tries to drop the page cache before each read phase, and says whether it
could).

Rebuild: ``--rebuild-entries N`` writes N small chunk files with the daemon's
own record writer and times how long the disk tier takes to rebuild its index
from them (what a restart costs).

Usage: python benchmarks/bench_disk.py [--dir DIR] [--total-mib 1024]
       [--rebuild-entries 100000] [--json PATH]
JSON rows: {"system": "daemon-disk"|"fio", "op": "write"|"read", "size_bytes": int, "mib_per_s": float}
(plus {"system": "daemon-disk", "op": "rebuild", "entries": int, "seconds": float} with --rebuild-entries).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import MIB, Processes, free_port, raise_on_sigterm, wait_until  # noqa: E402

from lmcache_client import CacheClient  # noqa: E402
from lmcache_client.memtune import tune_malloc  # noqa: E402

NAMESPACE = "bench-disk|float16|L1|KV1|D1|tp0of1|c256"


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run_fio(directory: Path, rw: str, size: int, count: int) -> float:
    """MiB/s of fio sequential ``rw`` over ``count`` files of ``size`` bytes."""
    out = subprocess.run(
        ["fio", "--name=seq", f"--rw={rw}", f"--bs={size}", f"--filesize={size}", f"--nrfiles={count}",
         f"--size={size * count}", f"--directory={directory}", "--ioengine=psync", "--numjobs=1",
         "--file_service_type=sequential", "--fallocate=none", "--output-format=json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    job = json.loads(out.stdout)["jobs"][0]
    return float(job["write" if rw == "write" else "read"]["bw_bytes"]) / MIB


def daemon_round(workdir: Path, spill: Path, size: int, count: int) -> tuple[float, float]:
    """(write MiB/s, read MiB/s) of ``count`` chunks of ``size`` through the daemon's disk tier."""
    procs = Processes(workdir)
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    total = size * count
    try:
        daemon = procs.start("daemon", [
            sys.executable, "-m", "lmcache_server", "--listen", address, "--metrics-port", "0",
            "--max-local-cpu-size", f"{max(4 * size, 16 * MIB)}B",
            "--set", f"local_disk=file://{spill}", "--set", f"max_local_disk_size={2 * total + 64 * MIB}B",
            "--set", f"max_spill_queue_size={total + 64 * MIB}B",
            "--set", f"max_inflight_bytes={max(1024 * MIB, 4 * size)}B",
        ])  # fmt: skip
        with CacheClient(address, NAMESPACE, timeout_s=60, fail_open=False) as c:
            wait_until(lambda: _pingable(c), 30, "daemon", daemon.check_alive)
            keys = [os.urandom(32) for _ in range(count)]
            payload = os.urandom(size)
            started = time.perf_counter()
            for key in keys:
                c.put([key], [payload])
            wait_until(lambda: _spilled(c) >= count - 4, 600, "spills", daemon.check_alive)
            write = _spilled(c) * size / MIB / (time.perf_counter() - started)
            on_disk = [k for k, t in zip(keys, c.lookup(keys).tiers) if t == "disk"]
            drop_page_cache()
            started = time.perf_counter()
            for key in on_disk:
                [got] = c.get([key])
                assert got is not None and len(got) == size
            read = len(on_disk) * size / MIB / (time.perf_counter() - started)
            stats = c.stats()["tiers"]["disk"]
            assert stats["spills_dropped"] == 0 and stats["corrupt"] == 0, stats
        return write, read
    finally:
        procs.stop_all()


def _pingable(c: CacheClient) -> bool:
    try:
        c.ping(timeout_s=0.5)
        return True
    except Exception:
        return False


def _spilled(c: CacheClient) -> int:
    disk = c.stats()["tiers"]["disk"]
    return int(disk["spills"]) if disk["queued_spills"] == 0 else 0


def rebuild_time(directory: Path, entries: int) -> float:
    """Seconds the disk tier takes to rebuild its index from ``entries`` chunk files."""
    from lmcache_server.storage.base import ChunkKey
    from lmcache_server.storage.chunkfile import encode_header
    from lmcache_server.storage.disk import DiskTier
    from lmcache_server.storage.diskfiles import HEADER_BLOCK, path_for, write_record

    payload = os.urandom(4096)
    for i in range(entries):
        key = ChunkKey(NAMESPACE, i.to_bytes(32, "little"))
        header = encode_header(key.namespace, key.digest, payload, pad_to=HEADER_BLOCK)
        write_record(path_for(directory, key), header, payload, "none")
        if i and i % 20000 == 0:
            print(f"  wrote {i} files", flush=True)
    drop_page_cache()

    async def open_tier() -> float:
        tier = DiskTier(directory, 1 << 40)
        await tier.open()
        assert tier.stats()["chunks"] == entries
        seconds = float(tier.counters.rebuild_seconds)
        await tier.close()
        return seconds

    return asyncio.run(open_tier())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, help="directory to test in (default: a temp dir under /tmp)")
    parser.add_argument("--sizes-mib", type=int, nargs="*", default=[4, 16])
    parser.add_argument("--total-mib", type=int, default=1024, help="bytes written per size and system")
    parser.add_argument("--rebuild-entries", type=int, default=0)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    raise_on_sigterm()
    tune_malloc()
    if shutil.which("fio") is None:
        sys.exit("fio is not installed (apt-get install fio)")
    base = Path(tempfile.mkdtemp(prefix="bench-disk-", dir=args.dir))
    rows: list[dict[str, Any]] = []
    can_drop = drop_page_cache()
    print(f"directory {base}; page cache dropped before reads: {'yes' if can_drop else 'no (not permitted)'}")
    try:
        print(f"{'size':>6} {'op':<6} {'daemon MiB/s':>13} {'fio MiB/s':>10} {'ratio':>6}")
        for size_mib in args.sizes_mib:
            size = size_mib * MIB
            count = max(8, args.total_mib // size_mib)
            fio_dir = base / f"fio-{size_mib}"
            fio_dir.mkdir()
            fio_write = run_fio(fio_dir, "write", size, count)
            drop_page_cache()
            fio_read = run_fio(fio_dir, "read", size, count)
            shutil.rmtree(fio_dir)
            run_dir = base / f"daemon-{size_mib}"
            run_dir.mkdir()
            write, read = daemon_round(run_dir, run_dir / "spill", size, count)
            shutil.rmtree(run_dir)
            for op, ours, theirs in (("write", write, fio_write), ("read", read, fio_read)):
                print(f"{size_mib:>4}Mi {op:<6} {ours:>13.0f} {theirs:>10.0f} {ours / theirs:>6.2f}"
                      f"  {'PASS' if ours >= 0.7 * theirs else 'MISS'} (target >= 0.7x fio)", flush=True)  # fmt: skip
                rows.append({"system": "daemon-disk", "op": op, "size_bytes": size, "mib_per_s": round(ours, 1)})
                rows.append({"system": "fio", "op": op, "size_bytes": size, "mib_per_s": round(theirs, 1)})
        if args.rebuild_entries:
            print(f"rebuild: writing {args.rebuild_entries} chunk files ...", flush=True)
            seconds = rebuild_time(base / "rebuild", args.rebuild_entries)
            print(f"rebuild: index of {args.rebuild_entries} entries rebuilt in {seconds:.2f}s")
            rows.append({"system": "daemon-disk", "op": "rebuild", "entries": args.rebuild_entries,
                         "seconds": round(seconds, 3)})  # fmt: skip
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
