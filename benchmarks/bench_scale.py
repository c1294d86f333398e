"""Metadata at scale: daemon memory per cached chunk, index rebuild at 1M disk entries,
and the RSS of a daemon with a 16 GiB pool (issue #15, item 4).

1. Bytes per entry.  The daemon's real stores are built in this process: a
   :class:`MemoryTier` over an anonymous pool of ``N`` 4 KiB pages with the
   ``adaptive`` (default) or ``lfuda`` policy, fed puts of 4-chunk prefix
   chains (a fresh namespace string per put, as decoded from a request) and
   gets of earlier heads, ``--churn`` x N chunks in all, so N stay cached and
   the bounded histories of evicted and refused keys fill as in a long run.
   Payloads are never copied in (``reserve``/``commit`` only):
   the pool's pages stay untouched and every byte measured is metadata.  The
   disk index is a :class:`DiskTier` opened on N real chunk files (written
   with the daemon's record writer, :func:`_harness.write_chunk_files`) from
   its snapshot.  Reported per cached chunk: the tracemalloc delta split by
   the file that allocated (memory tier, policy, keys) and the RSS delta.
2. Rebuild at 1M: the disk tier's ``open`` from the snapshot a clean close
   left, and by the scan (every header read, as after a crash), page cache
   dropped before each when we may.  The scan runs at ``--scan-entries`` and
   is extrapolated linearly to 1M when that is smaller (labelled so).
3. RSS: ``python -m lmcache_server`` with a 16 GiB pool (``warm_restart``
   false, no disk) filled with ``--daemon-chunks`` chunks of 4 KiB over
   ZeroMQ; its VmRSS against pool bytes allocated + 150 MiB + chunks x the
   measured bytes per entry.

Targets (issue #15): <= 600 B per entry; snapshot restart of 1M entries in
<= 10 s; RSS <= pool touched + 150 MiB + metadata.

Run under the shared lock: ``flock /tmp/lmcache-bench.lock python benchmarks/bench_scale.py
[--entries 100000,1000000] [--policies adaptive,lfuda] [--churn 2] [--disk-entries 100000]
[--rebuild-entries 1000000]
[--scan-entries 100000] [--daemon-chunks 200000] [--metadata-bytes B] [--dir DIR] [--json PATH]]``
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import MIB, Processes, free_port, raise_on_sigterm, start_daemon, write_chunk_files  # noqa: E402
from bench_disk import drop_page_cache  # noqa: E402

from lmcache_server.storage.base import ChunkKey  # noqa: E402
from lmcache_server.storage.disk import DiskTier  # noqa: E402
from lmcache_server.storage.disk import snapshot as disksnapshot  # noqa: E402
from lmcache_server.storage.memory import (  # noqa: E402
    MemoryPool,  # noqa: E402
    MemoryTier,
    Reservation,
)
from lmcache_server.storage.policy import make_policy  # noqa: E402

PAGE = 4096
NAMESPACE = "bench-scale/Qwen2.5-7B-Instruct|bfloat16|L28|KV4|D128|tp0of1|c256|codec=none"
TARGET_BYTES_PER_ENTRY = 600
TARGET_SNAPSHOT_S = 10.0
RSS_SLACK = 150 * MIB
CHAIN = 4
FILE_PAYLOAD = 1024  # bytes per chunk file


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def digest(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


def _group(filename: str) -> str:
    name = os.path.basename(filename)
    room = os.path.basename(os.path.dirname(filename))  # the storage subpackage
    if room == "policy":
        return "policy"
    if (room == "memory" and name in ("tier.py", "entry.py", "warm.py", "allocator.py")) or name == "tenants.py":
        return "memory tier"
    if room == "disk" and name in ("tier.py", "snapshot.py", "files.py"):
        return "disk index"
    if name == os.path.basename(__file__):
        return "keys"
    return "other"


def _split(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot) -> dict[str, int]:
    parts: dict[str, int] = {}
    for stat in after.compare_to(before, "filename"):
        group = _group(stat.traceback[0].filename)
        parts[group] = parts.get(group, 0) + stat.size_diff
    return parts


class Traced:
    """Python memory allocated (tracemalloc, split by file group) and RSS grown
    between :meth:`start` and :meth:`stop`."""

    def start(self) -> None:
        gc.collect()
        self.rss0 = rss_bytes()
        tracemalloc.start(1)
        self.before = tracemalloc.take_snapshot()
        self.used0 = tracemalloc.get_traced_memory()[0]

    def stop(self) -> tuple[int, int, dict[str, int]]:
        """(bytes allocated, RSS growth, bytes per file group)."""
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - self.used0
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        parts = _split(self.before, after)
        del self.before, after
        gc.collect()
        return used, rss_bytes() - self.rss0, parts


def fill_memory(n: int, policy_name: str, churn: float) -> dict[str, Any]:
    """A memory tier holding ``n`` chunks after ``churn`` x n chunks were put; bytes per chunk."""
    pool = MemoryPool(n * PAGE, pin_memory="off", shm_dir=None)
    traced = Traced()
    traced.start()
    tier = MemoryTier(pool, 0, make_policy(policy_name, pool.size, PAGE))
    total = int(churn * n)
    started = time.perf_counter()
    put = 0
    i = 0
    while put < total:
        namespace = NAMESPACE.encode().decode()  # a new string, as a request's header gives
        if i >= CHAIN:  # a get of an earlier put's head (a hit if it is still held)
            head = ChunkKey(namespace, digest(max(0, i // CHAIN - 1 - (i * 7919) % 16) * CHAIN))
            if tier.peek(head):
                _get_now(tier, head).release()
        parent: ChunkKey | None = None
        for _ in range(CHAIN):
            key = ChunkKey(namespace, digest(i))
            i += 1
            r = tier.reserve(key, PAGE, parent)
            if isinstance(r, Reservation):
                r.view = memoryview(b"")  # nothing copied in: the page stays untouched
                tier.commit(r)
            put += 1
            parent = key
        if put % 200000 < CHAIN:
            print(f"  {policy_name} n={n}: {put}/{total} chunks put, {tier.chunks} held"
                  f" ({time.perf_counter() - started:.0f}s)", flush=True)  # fmt: skip
    seconds = time.perf_counter() - started
    used, rss, parts = traced.stop()
    held = tier.chunks
    row = {
        "part": "memory", "policy": policy_name, "entries": held, "puts": total,
        "bytes_per_entry": used / held, "rss_bytes_per_entry": rss / held,
        "split": {k: v / held for k, v in parts.items()}, "us_per_put": 1e6 * seconds / total,
        **({"policy_stats": tier.policy.stats()} if hasattr(tier.policy, "stats") else {}),
    }  # fmt: skip
    tier._index.clear()
    del tier
    pool.close()
    gc.collect()
    return row


def _get_now(tier: MemoryTier, key: ChunkKey) -> Any:
    coro = tier.get(key)
    try:
        coro.send(None)
    except StopIteration as done:  # get never awaits: it finishes at the first send
        return done.value
    raise RuntimeError("MemoryTier.get awaited")


async def _open_disk(root: Path, policy_name: str) -> DiskTier:
    tier = DiskTier(root, 1 << 50, policy=make_policy(policy_name), io_threads=2)
    await tier.open()
    return tier


def disk_index(root: Path, n: int, policy_name: str) -> tuple[dict[str, Any], float]:
    """Open a disk tier on ``n`` files from its snapshot: bytes per entry and the rebuild seconds."""

    async def run() -> tuple[dict[str, Any], float]:
        # The snapshot a clean close of a tier holding these files writes (not opening it
        # first: that would scan a million files).
        disksnapshot.save(root, [(ChunkKey(NAMESPACE, i.to_bytes(32, "little")), FILE_PAYLOAD) for i in range(n)])
        drop_page_cache()
        gc.collect()
        timed = await _open_disk(root, policy_name)  # the restart, timed without tracemalloc
        assert timed.counters.rebuilt_from_snapshot == 1 and timed.stats()["chunks"] == n
        seconds = float(timed.counters.rebuild_seconds)
        await timed.close()  # writes the snapshot again
        del timed
        traced = Traced()
        traced.start()
        tier = await _open_disk(root, policy_name)
        used, rss, parts = traced.stop()
        assert tier.counters.rebuilt_from_snapshot == 1 and tier.stats()["chunks"] == n
        await tier.close()
        row = {
            "part": "disk", "policy": policy_name, "entries": n, "bytes_per_entry": used / n,
            "rss_bytes_per_entry": rss / n, "split": {k: v / n for k, v in parts.items()},
        }  # fmt: skip
        return row, seconds

    return asyncio.run(run())


def scan_seconds(root: Path, n: int) -> float:
    async def run() -> float:
        drop_page_cache()
        tier = await _open_disk(root, "lfuda")
        assert tier.counters.rebuilt_from_snapshot == 0 and tier.stats()["chunks"] == n
        seconds = float(tier.counters.rebuild_seconds)
        await tier.close()
        return seconds

    (root / "v1" / "index.snapshot").unlink(missing_ok=True)
    return asyncio.run(run())


def daemon_rss(workdir: Path, chunks: int, per_entry: float) -> dict[str, Any]:
    from lmcache_client import CacheClient

    procs = Processes(workdir)
    port = free_port()
    try:
        child = start_daemon(procs, "daemon", port, {
            "max_local_cpu_size": "16GiB", "warm_restart": "false", "max_inflight_bytes": "1GiB",
        })  # fmt: skip
        pid = child.proc.pid
        rss_start = rss_bytes(pid)
        payloads = [os.urandom(PAGE) for _ in range(64)]
        with CacheClient(f"tcp://127.0.0.1:{port}", NAMESPACE, timeout_s=60, fail_open=False) as c:
            for start in range(0, chunks, 64):
                keys = [digest(i) for i in range(start, min(chunks, start + 64))]
                c.put(keys, payloads[: len(keys)])
                if start and start % 100000 == 0:
                    print(f"  daemon: {start} chunks put, RSS {rss_bytes(pid) / MIB:.0f} MiB", flush=True)
            stats = c.stats()["tiers"]["memory"]
        rss = rss_bytes(pid)
        allowed = stats["allocated_bytes"] + RSS_SLACK + stats["chunks"] * per_entry
        return {
            "part": "daemon", "chunks": stats["chunks"], "rss_start": rss_start, "rss": rss,
            "pool_allocated": stats["allocated_bytes"], "allowed": allowed, "pool_bytes": 16 << 30,
        }  # fmt: skip
    finally:
        procs.stop_all()


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", default="100000,1000000", help="memory tier sizes (chunks held)")
    ap.add_argument("--disk-entries", default="100000", help="disk index sizes (besides --rebuild-entries)")
    ap.add_argument("--policies", default="adaptive,lfuda")
    ap.add_argument("--churn", type=float, default=2.0, help="chunks put per chunk held")
    ap.add_argument("--rebuild-entries", type=int, default=1000000, help="0: no disk part")
    ap.add_argument("--scan-entries", type=int, default=100000)
    ap.add_argument("--daemon-chunks", type=int, default=200000)
    ap.add_argument(
        "--metadata-bytes",
        type=float,
        default=0.0,
        help="metadata per chunk the RSS check allows (default: measured in this run, else the target)",
    )
    ap.add_argument(
        "--files",
        type=Path,
        default=None,
        help="keep the chunk files under this directory, one folder per size (reused by the next run)",
    )
    ap.add_argument("--dir", type=Path, default=None, help="where the chunk files go (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    raise_on_sigterm()
    sizes = [int(x) for x in args.entries.split(",") if x]
    policies = [p for p in args.policies.split(",") if p]
    rows: list[dict[str, Any]] = []
    lines: list[str] = []
    base = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.dir))
    files = args.files if args.files is not None else base / "disk"
    try:
        for n in sizes:
            for policy in policies:
                print(f"memory tier: {n} entries, {policy} ...", flush=True)
                row = fill_memory(n, policy, args.churn)
                rows.append(row)
                split = ", ".join(f"{k} {v:.0f}" for k, v in sorted(row["split"].items()))
                print(f"memory tier + {policy} policy at {n}: {row['bytes_per_entry']:.0f} B/entry traced"
                      f" ({split}), {row['rss_bytes_per_entry']:.0f} B/entry RSS (with tracemalloc's own records),"
                      f" {row['us_per_put']:.1f} us/put",
                      flush=True)  # fmt: skip
                lines.append(f"{verdict(row['bytes_per_entry'] <= TARGET_BYTES_PER_ENTRY)} memory tier + {policy}"
                             f" at {n}: {row['bytes_per_entry']:.0f} B/entry"
                             f" ({row['bytes_per_entry'] / TARGET_BYTES_PER_ENTRY:.2f}x the 600 B target)")  # fmt: skip
        disk_sizes = sorted(({int(x) for x in args.disk_entries.split(",") if x} | {args.rebuild_entries}) - {0})
        if not args.rebuild_entries:
            disk_sizes = []
        snapshot_at: dict[int, float] = {}
        for n in disk_sizes:
            print(f"disk index: writing chunk files up to {n} ...", flush=True)
            t0 = time.perf_counter()
            root = files / str(n)
            written = _written(root)
            if n > written:
                _write_more(root, written, n)
            print(f"  {n} files there ({time.perf_counter() - t0:.0f}s)", flush=True)
            row, seconds = disk_index(root, n, "lfuda")  # the disk tier's policy under adaptive too
            snapshot_at[n] = seconds
            rows.append({**row, "snapshot_seconds": seconds})
            split = ", ".join(f"{k} {v:.0f}" for k, v in sorted(row["split"].items()))
            print(
                f"disk index at {n}: {row['bytes_per_entry']:.0f} B/entry traced ({split}),"
                f" {row['rss_bytes_per_entry']:.0f} B/entry RSS (with tracemalloc's own records);"
                f" restart from snapshot {seconds:.2f}s",
                flush=True,
            )
            lines.append(f"{verdict(row['bytes_per_entry'] <= TARGET_BYTES_PER_ENTRY)} disk index + lfuda at {n}:"
                         f" {row['bytes_per_entry']:.0f} B/entry"
                         f" ({row['bytes_per_entry'] / TARGET_BYTES_PER_ENTRY:.2f}x the 600 B target)")  # fmt: skip
            if n == args.rebuild_entries:
                lines.append(f"{verdict(seconds <= TARGET_SNAPSHOT_S)} snapshot restart of {n} entries: {seconds:.2f}s"
                             f" ({seconds / TARGET_SNAPSHOT_S:.2f}x the 10 s target)")  # fmt: skip
            if n == args.scan_entries or (n == disk_sizes[-1] and args.scan_entries >= n):
                scan = scan_seconds(root, n)
                factor = args.rebuild_entries / n
                label = "measured" if factor == 1 else f"extrapolated x{factor:g} from {n} files"
                print(f"scan rebuild of {n} files: {scan:.2f}s; at {args.rebuild_entries}: {scan * factor:.1f}s"
                      f" ({label})", flush=True)  # fmt: skip
                rows.append({"part": "scan", "entries": n, "seconds": scan, "at_rebuild_entries": scan * factor})
                lines.append(f"INFO scan rebuild of {args.rebuild_entries} entries: {scan * factor:.1f}s ({label};"
                             f" {scan / snapshot_at[n]:.1f}x the snapshot's time at {n})")  # fmt: skip
        if args.daemon_chunks:
            measured = [r["bytes_per_entry"] for r in rows if r["part"] == "memory" and r["policy"] == "adaptive"]
            per_entry = args.metadata_bytes or max(measured or [TARGET_BYTES_PER_ENTRY])
            print(f"daemon: 16 GiB pool, {args.daemon_chunks} chunks of 4 KiB ...", flush=True)
            d = daemon_rss(base, args.daemon_chunks, per_entry)
            rows.append(d)
            print(f"daemon RSS {d['rss'] / MIB:.0f} MiB (at start {d['rss_start'] / MIB:.0f} MiB) with"
                  f" {d['chunks']} chunks, {d['pool_allocated'] / MIB:.0f} MiB of the 16 GiB pool allocated;"
                  f" allowed {d['allowed'] / MIB:.0f} MiB", flush=True)  # fmt: skip
            lines.append(f"{verdict(d['rss'] <= d['allowed'])} daemon RSS with a 16 GiB pool: {d['rss'] / MIB:.0f} MiB"
                         f" <= pool touched + 150 MiB + metadata = {d['allowed'] / MIB:.0f} MiB"
                         f" ({d['rss'] / d['allowed']:.2f}x)")  # fmt: skip
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print()
    for line in lines:
        print(line)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def _write_more(root: Path, have: int, want: int) -> None:
    """Chunk files ``have``..``want`` (the first ``have`` are there already)."""
    write_chunk_files(root, want, NAMESPACE, payload_bytes=FILE_PAYLOAD, start=have)
    (root / "written").write_text(str(want))


def _written(root: Path) -> int:
    """How many chunk files a run left in ``root`` (``--files``)."""
    try:
        return int((root / "written").read_text())
    except (OSError, ValueError):
        return 0


if __name__ == "__main__":
    sys.exit(main())
