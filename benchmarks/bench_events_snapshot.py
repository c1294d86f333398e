"""Event snapshots: how fast a restarted router has a complete index, what a snapshot
costs, and whether snapshot requests slow puts (docs/events.md, "Snapshot").

1. **Recovery.**  A daemon with events and a snapshot endpoint holds
   ``--chunks`` (100,000) announced chunks of 256 tokens (4 KiB payloads, so
   they fit the pool; puts of 256 chunks with their token ids).  A "router"
   restarts: it asks for a snapshot and builds its index (per topic and medium:
   block hash -> parent, and per event its token ids) as the batches arrive,
   keeping token ids as the bytes they came in (a compiled router decodes them
   into a u32 vector; :func:`index_batch`).  Printed: the time from its request
   to a complete index (target <= 1 s); the daemon's part alone (every batch
   received before any is indexed); the first router of this benchmark (every
   token id msgpack-decoded into a Python int, after the end marker), labelled;
   the snapshot's bytes per chunk, the daemon's longest ping (from a process of
   its own) while it served the snapshot (up to the end marker), and what the
   daemon keeps per chunk for it (``kept_bytes``, token ids and block hashes,
   and the RSS against an identical daemon without events).  With ``--dynamo``:
   NVIDIA Dynamo's own indexer (.venv-dynamo) fed the same snapshot
   (:func:`dynamo_index`), a real router's index time.
2. **Puts under snapshot load.**  Two daemons, interleaved (``measure_group``):
   events off, and events on + snapshot endpoint with a client (a process of
   its own) requesting a snapshot every ``--snapshot-interval-s`` (0.1 s; 0:
   back to back, which on a small host mostly measures that client's CPU); puts of ``--chunks-per-put`` chunks
   of ``--chunk-mib`` (4) MiB with token ids.  Printed: MiB/s of both and the
   ratio (target >= 0.95).

Run (a heavy run): ``flock /tmp/heavy.lock python benchmarks/bench_events_snapshot.py``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import sys
import time
from array import array
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Child, Processes, free_port, measure_group, raise_on_sigterm, workspace  # noqa: E402
from _harness import start_daemon as harness_start_daemon  # noqa: E402
from _snapshot_router import BLOCK, dynamo_index, router_restart  # noqa: E402

from lmcache_client import CacheClient  # noqa: E402
from lmcache_client.keys import ChunkTokens, chunk_keys, chunk_tokens  # noqa: E402

CHUNK_TOKENS = 256
NAMESPACE = "bench/snapshot|bfloat16|L32|KV8|D128|tp0of1|c256"


def start(procs: Processes, name: str, shm: Path, pool: str, extra: dict[str, object]) -> tuple[Child, int]:
    port = free_port()
    (shm / name).mkdir(parents=True)
    settings: dict[str, object] = {
        "max_local_cpu_size": pool,
        "shm_dir": str(shm / name),
        "warm_restart": "false",
        "cache_policy": "lru",
        "stats_log_interval_s": 0,
        **extra,
    }
    return harness_start_daemon(procs, name, port, settings), port


def rss_mib(child: Child) -> float:
    for line in Path(f"/proc/{child.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def prompts(n_chunks: int, per_prompt: int, seed: int) -> list[tuple[list[bytes], list[ChunkTokens]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(0, n_chunks, per_prompt):
        tokens = [rng.randrange(150_000) for _ in range(per_prompt * CHUNK_TOKENS)]
        out.append((chunk_keys(tokens, CHUNK_TOKENS), chunk_tokens(tokens, CHUNK_TOKENS)))
    return out


def ping_loop(port: int, stop: Any, result: Any) -> None:
    """Ping the daemon until ``stop``; put the longest round trip (seconds) on ``result``."""
    worst = 0.0
    with CacheClient(f"tcp://127.0.0.1:{port}", NAMESPACE, timeout_s=60, fail_open=False) as c:
        c.ping()
        result.put("ready")
        while not stop.is_set():
            worst = max(worst, c.ping())
    result.put(worst)


def snapshot_loop(endpoint: str, interval_s: float, stop: Any, served: Any) -> None:
    """Ask for a snapshot every ``interval_s`` (0: back to back) until ``stop``; put how
    many were served on ``served``."""
    router_restart(endpoint)
    served.put("ready")
    n = 0
    while not stop.wait(interval_s):
        router_restart(endpoint)
        n += 1
    served.put(n)


def recovery(args: argparse.Namespace, procs: Processes, shm: Path, workdir: Path) -> None:
    endpoint = f"ipc://{workdir}/snapshot.sock"
    events = {
        "events_endpoint": f"ipc://{workdir}/events.sock",
        "events_snapshot_endpoint": endpoint,
        "events_replay_size": "16MiB",
    }
    work = prompts(args.chunks, 256, 3)
    payloads = [os.urandom(4096)] * 256
    daemons = [start(procs, "plain100k", shm, "2GiB", {}), start(procs, "events100k", shm, "2GiB", events)]
    for (_, port), tokens in zip(daemons, (False, True)):
        with CacheClient(f"tcp://127.0.0.1:{port}", NAMESPACE, timeout_s=60, fail_open=False) as c:
            for keys, toks in work:
                assert all(s == 0 for s in c.put(keys, payloads, tokens=toks if tokens else None))
    (plain, _), (child, port) = daemons
    with CacheClient(f"tcp://127.0.0.1:{port}", NAMESPACE, timeout_s=60, fail_open=False) as c:
        while c.stats()["events"]["pending_events"]:
            time.sleep(0.1)
        stats = c.stats()["events"]
        runs = []
        for _ in range(args.snapshots):
            # The daemon's part alone (every batch received before any is indexed; the
            # pinger, a process of its own, runs until the end marker), then both routers
            # from those batches; then a router that indexes as the batches arrive.
            ctx = multiprocessing.get_context("spawn")
            result = ctx.Queue()
            stop = ctx.Event()
            pinger = ctx.Process(target=ping_loop, args=(port, stop, result))
            pinger.start()
            assert result.get(timeout=60) == "ready"
            apart = router_restart(endpoint, stop, stream=False, full_decode=True)
            worst_ping = result.get(timeout=60)
            pinger.join(10)
            runs.append((router_restart(endpoint), apart, worst_ping))

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    run = runs[0][0]
    chunks, nbytes = run.chunks, run.nbytes
    print(
        f"recovery: a node holding {chunks:,} chunks ({run.blocks:,} blocks of {BLOCK} tokens), median of {len(runs)}"
    )
    print(
        f"  index complete {median([r.built_s for r, _, _ in runs]):.3f} s after the router's request (target <= 1 s): "
        "each batch indexed as it arrives, token ids kept packed as a compiled router reads them"
    )
    print(
        f"  received alone (the daemon's part): {median([a.received_s for _, a, _ in runs]):.3f} s; "
        f"then indexed: {median([a.built_s for _, a, _ in runs]):.3f} s after the request"
    )
    print(
        "  the first router (receive all, then msgpack every token id into a Python int): "
        f"{median([a.decoded_s or 0.0 for _, a, _ in runs]):.3f} s"
    )
    print(f"  snapshot: {nbytes / 2**20:.1f} MiB, {nbytes / chunks:,.0f} bytes per chunk of {CHUNK_TOKENS} tokens")
    print(f"  the daemon's longest ping during a snapshot: {median([w for _, _, w in runs]) * 1000:.1f} ms")
    print(
        f"  kept for snapshots and media changes: {stats['kept_bytes'] / chunks:,.0f} bytes per chunk "
        f"(token ids + block hashes); RSS {rss_mib(child):,.0f} MiB vs {rss_mib(plain):,.0f} MiB without events "
        f"(+{(rss_mib(child) - rss_mib(plain)) * 2**20 / chunks:,.0f} bytes per chunk, the replay buffer included)"
    )
    if args.dynamo:
        last = array("I", b"".join(t.packed for t in work[-1][1])).tolist()
        dynamo_index(run.frames, last, NAMESPACE.split("|", 1)[0], workdir)
    procs.stop(plain)
    procs.stop(child)


def throughput(args: argparse.Namespace, procs: Processes, shm: Path, workdir: Path) -> None:
    endpoint = f"ipc://{workdir}/snapshot4m.sock"
    size = int(args.chunk_mib * 2**20)
    per_call = size * args.chunks_per_put
    n = args.warmup + args.calls * args.reps
    work = {"plain": prompts(n * args.chunks_per_put, args.chunks_per_put, 1)}
    work["events"] = prompts(n * args.chunks_per_put, args.chunks_per_put, 2)
    payloads = [os.urandom(size) for _ in range(args.chunks_per_put)]
    _, plain_port = start(procs, "plain", shm, args.pool_size, {})
    events = {"events_endpoint": f"ipc://{workdir}/events4m.sock", "events_snapshot_endpoint": endpoint}
    _, events_port = start(procs, "events", shm, args.pool_size, events)
    plain = CacheClient(f"tcp://127.0.0.1:{plain_port}", NAMESPACE, timeout_s=30, fail_open=False)
    client = CacheClient(f"tcp://127.0.0.1:{events_port}", NAMESPACE, timeout_s=30, fail_open=False)
    turn = {"plain": 0, "events": 0}

    def put_plain() -> None:
        keys, _ = work["plain"][turn["plain"]]
        turn["plain"] += 1
        assert all(s == 0 for s in plain.put(keys, payloads))

    def put_events() -> None:
        keys, tokens = work["events"][turn["events"]]
        turn["events"] += 1
        assert all(s == 0 for s in client.put(keys, payloads, tokens=tokens))

    # The snapshot client is a process of its own: in this one its decoding would hold
    # the GIL the put client needs.
    ctx = multiprocessing.get_context("spawn")
    stop, served = ctx.Event(), ctx.Queue()
    loader = ctx.Process(target=snapshot_loop, args=(endpoint, args.snapshot_interval_s, stop, served))
    loader.start()
    assert served.get(timeout=60) == "ready"
    try:
        base, with_snapshots = measure_group(
            [(put_plain, None), (put_events, None)], per_call, args.calls, args.reps, args.warmup
        )
    finally:
        stop.set()
        count = served.get(timeout=120)
        loader.join(10)
    print(
        f"puts of {args.chunks_per_put} x {args.chunk_mib:g} MiB chunks, pool {args.pool_size}, "
        f"{args.reps} reps of {args.calls} puts"
    )
    load = f"a snapshot every {args.snapshot_interval_s:g} s" if args.snapshot_interval_s else "snapshots back to back"
    print(f"  events off: {base.median:8,.0f} MiB/s {base.spread()}")
    print(f"  events on + {load}: {with_snapshots.median:8,.0f} MiB/s {with_snapshots.spread()}")
    print(f"  ratio: {with_snapshots.median / base.median:.3f}x (target >= 0.95); {count} snapshots served")
    plain.close()
    client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=100_000, help="chunks the node holds for the recovery")
    parser.add_argument("--snapshots", type=int, default=5, help="router restarts timed")
    parser.add_argument("--pool-size", default="1GiB")
    parser.add_argument("--chunk-mib", type=float, default=4.0)
    parser.add_argument("--chunks-per-put", type=int, default=4)
    parser.add_argument("--calls", type=int, default=60, help="puts per timed repetition")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--snapshot-interval-s",
        type=float,
        default=0.1,
        help="a snapshot request this often during the puts (0: back to back)",
    )
    parser.add_argument("--skip-recovery", action="store_true")
    parser.add_argument(
        "--dynamo",
        action="store_true",
        help="also time NVIDIA Dynamo's indexer (.venv-dynamo) rebuilding its index from the snapshot",
    )
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    raise_on_sigterm()
    with workspace("bench-snapshot-") as (procs, workdir):
        shm = Path("/dev/shm") / workdir.name
        try:
            if not args.skip_recovery:
                recovery(args, procs, shm, workdir)
            if not args.skip_throughput:
                throughput(args, procs, shm, workdir)
        finally:
            import shutil

            shutil.rmtree(shm, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
