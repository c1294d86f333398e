"""Disk tier throughput through the daemon vs fio in the same directory, and index rebuild time.

Write: puts of 4 and 16 MiB chunks into a daemon whose memory tier holds only
a few of them, so every put evicts one chunk that spills to the disk tier;
throughput = bytes that reached the disk / time from the first put until the
spill queue is empty (the queue is sized to hold the whole run: nothing is
dropped).  Read: gets of chunks that are only on disk (each one read,
checksummed, promoted into memory and sent), through the real daemon with
the thin client's defaults (on one host: the shared-memory path).

Baseline, in the same run and the same directory: fio sequential write and read
of files of the same size (one file per chunk, block size = chunk size, psync,
one job), in two modes, each beside the daemon in the same mode:

- ``direct``: fio ``--direct=1``, and the daemon with ``disk_direct_io: true``
  (its default: chunk files written with O_DIRECT straight from the pool; reads
  go through the page cache, whose pages for the file are dropped after).
- ``buffered``: fio buffered, and the daemon with ``disk_direct_io: false``.
  A buffered write ends in the page cache: with a run much smaller than RAM
  (and the dirty-page limit) it measures copies into memory, not the disk,
  and on a 2-core machine the CPU decides the figure.

**The target is judged for the daemon's default configuration against fio
doing the same kind of I/O**: writes against fio direct (both put the bytes on
the device), reads against fio buffered (both read through the page cache,
from cold).  Every other pairing is printed too, ratios included.  The
daemon keeps ``disk_io_threads`` (2) writes in flight, fio one.

Read phases start from a dropped page cache (the script says whether it could
drop it), so both read paths go to the device.  Every write phase starts
after a ``sync``, so no writeback of the previous phase runs under it.

Rebuild: ``--rebuild-entries N`` writes N small chunk files with the daemon's
own record writer and times how long the disk tier takes to rebuild its index
from them (what a restart costs): by the scan (every file's header read, as
after a crash), and from the index snapshot a clean shutdown leaves.

Usage: python benchmarks/bench_disk.py [--dir DIR] [--total-mib 1024]
       [--rebuild-entries 100000] [--json PATH]
JSON rows: {"system": "daemon-disk"|"fio", "op": "write"|"read", "size_bytes": int, "mib_per_s": float,
"mode": "direct"|"buffered"} (plus {"system": "daemon-disk", "op": "rebuild", "entries": int,
"seconds": float, "source": "scan"|"snapshot"} with --rebuild-entries).
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
from _harness import MIB, Processes, free_port, raise_on_sigterm, wait_until, write_chunk_files  # noqa: E402

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


MODES = ("direct", "buffered")
JUDGED = {"write": "direct", "read": "buffered"}  # fio mode each op of the default daemon is judged against


def run_fio(directory: Path, rw: str, size: int, count: int, mode: str) -> float:
    """MiB/s of fio sequential ``rw`` over ``count`` files of ``size`` bytes."""
    out = subprocess.run(
        ["fio", "--name=seq", f"--rw={rw}", f"--bs={size}", f"--filesize={size}", f"--nrfiles={count}",
         f"--size={size * count}", f"--directory={directory}", "--ioengine=psync", "--numjobs=1",
         "--file_service_type=sequential", "--fallocate=none", "--output-format=json",
         f"--direct={int(mode == 'direct')}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    job = json.loads(out.stdout)["jobs"][0]
    return float(job["write" if rw == "write" else "read"]["bw_bytes"]) / MIB


def daemon_round(workdir: Path, spill: Path, size: int, count: int, mode: str) -> tuple[float, float]:
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
            "--set", f"disk_direct_io={'true' if mode == 'direct' else 'false'}",
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
            assert stats["direct_io"] == (mode == "direct"), stats
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


def rebuild_times(directory: Path, entries: int) -> tuple[float, float]:
    """Seconds the disk tier takes to rebuild its index of ``entries`` chunk files:
    by the scan (no snapshot: after a crash, or the first start), then from the
    snapshot its clean shutdown wrote.  The page cache is dropped before each."""
    from lmcache_server.storage.disk import DiskTier

    write_chunk_files(directory, entries, NAMESPACE)

    async def open_tier(from_snapshot: int) -> float:
        tier = DiskTier(directory, 1 << 40)
        await tier.open()
        assert tier.stats()["chunks"] == entries
        assert tier.counters.rebuilt_from_snapshot == from_snapshot
        seconds = float(tier.counters.rebuild_seconds)
        await tier.close()  # writes the snapshot
        return seconds

    drop_page_cache()
    scan = asyncio.run(open_tier(0))
    drop_page_cache()
    return scan, asyncio.run(open_tier(1))


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
        for size_mib in args.sizes_mib:
            size = size_mib * MIB
            count = max(8, args.total_mib // size_mib)
            got: dict[tuple[str, str, str], float] = {}  # (system, op, mode) -> MiB/s
            for mode in MODES:
                fio_dir = base / f"fio-{size_mib}-{mode}"
                fio_dir.mkdir()
                os.sync()
                got["fio", "write", mode] = run_fio(fio_dir, "write", size, count, mode)
                drop_page_cache()
                got["fio", "read", mode] = run_fio(fio_dir, "read", size, count, mode)
                shutil.rmtree(fio_dir)
                run_dir = base / f"daemon-{size_mib}-{mode}"
                run_dir.mkdir()
                os.sync()
                write, read = daemon_round(run_dir, run_dir / "spill", size, count, mode)
                got["daemon-disk", "write", mode], got["daemon-disk", "read", mode] = write, read
                shutil.rmtree(run_dir)
            print(f"{size_mib} MiB chunks, MiB/s  (daemon direct = disk_direct_io: true, the default)")
            print(f"  {'op':<6} {'daemon direct':>13} {'daemon buffered':>15} {'fio direct':>10} {'fio buffered':>12}")
            for op in ("write", "read"):
                print(f"  {op:<6} {got['daemon-disk', op, 'direct']:>13.0f} {got['daemon-disk', op, 'buffered']:>15.0f}"
                      f" {got['fio', op, 'direct']:>10.0f} {got['fio', op, 'buffered']:>12.0f}")  # fmt: skip
            for op in ("write", "read"):
                ours = got["daemon-disk", op, "direct"]
                judged = JUDGED[op]
                theirs = got["fio", op, judged]
                other = "buffered" if judged == "direct" else "direct"
                print(f"  {op}: daemon {ours / theirs:.2f}x fio {judged}"
                      f"  {'PASS' if ours >= 0.7 * theirs else 'MISS'} (target >= 0.7x)"
                      f";  {ours / got['fio', op, other]:.2f}x fio {other}"
                      f";  daemon buffered {got['daemon-disk', op, 'buffered'] / got['fio', op, 'buffered']:.2f}x"
                      f" fio buffered", flush=True)  # fmt: skip
            for (system, op, mode), rate in got.items():
                rows.append({"system": system, "op": op, "size_bytes": size, "mib_per_s": round(rate, 1), "mode": mode})
        print("judged: the default daemon's writes against fio --direct=1 (both end on the device; buffered writes"
              " of a run this size end in the page cache), its reads against fio buffered (both read through the"
              " page cache, from cold)")  # fmt: skip
        if args.rebuild_entries:
            print(f"rebuild: writing {args.rebuild_entries} chunk files ...", flush=True)
            scan, snap = rebuild_times(base / "rebuild", args.rebuild_entries)
            print(f"rebuild: index of {args.rebuild_entries} entries rebuilt in {scan:.2f}s by the scan,"
                  f" {snap:.2f}s from the snapshot of a clean shutdown (cold page cache both)")  # fmt: skip
            for source, seconds in (("scan", scan), ("snapshot", snap)):
                rows.append({"system": "daemon-disk", "op": "rebuild", "entries": args.rebuild_entries,
                             "seconds": round(seconds, 3), "source": source})  # fmt: skip
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
