"""KV events never slow puts: put throughput with a stalled subscriber vs. a daemon without events.

Two daemons with the same settings (``--pool-size`` memory pool, shared memory
on /dev/shm as an engine on the same host uses it), measured interleaved
(repetition i of both before repetition i+1 of either, so outside load lands
on both alike):

- **no events**: puts without token ids (a client sends none to a daemon
  whose hello offers no events);
- **events + stalled subscriber**: ``events_endpoint`` on, each put carrying
  its chunks' token ids (one BlockStored per chunk, and BlockRemoved as the
  pool fills and evicts), and a SUB socket subscribed to everything that
  never reads (receive high-water mark 1): the daemon's PUB queue to it fills
  and ZeroMQ drops batches for it.

Every put stores new chunks (prompts of ``--chunks-per-put`` chunks of
``--chunk-mib`` MiB, a hash chain each); keys and token ids are computed before
the timing.  Prints MiB/s (median [min..max]) of both and the ratio
(target >= 0.95), then the events daemon's counters (batches sent; the
subscriber's queue holds at most a few of them).

The events daemon batches as configured by default (``--batch-interval-s``
0.05) and queues at most ``--events-hwm`` (16) batches per subscriber, so the
stalled subscriber's queue is full for nearly the whole run.  Each batch
wakes the daemon's event loop once: ``--batch-interval-s 0.001`` (hundreds
of tiny batches) shows what that costs on a host whose cores are all busy.

The daemon's cost per announced chunk is fixed (SHA-256 per block, the token
ids into msgpack: tens of microseconds), so small chunks are the worst case:
``--chunk-mib 2`` shows it.

Run: ``python benchmarks/bench_events.py [--pool-size 1GiB] [--chunk-mib 14] [--chunks-per-put 4]``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Child, Processes, free_port, measure_group, raise_on_sigterm, workspace  # noqa: E402
from _harness import start_daemon as harness_start_daemon  # noqa: E402

from lmcache_client import CacheClient  # noqa: E402
from lmcache_client.keys import ChunkTokens, chunk_keys, chunk_tokens  # noqa: E402

CHUNK_TOKENS = 256
NAMESPACE = "bench/events|bfloat16|L32|KV8|D128|tp0of1|c256"


def start_daemon(
    procs: Processes, name: str, port: int, shm_dir: Path, pool: str, events: dict[str, object] | None
) -> Child:
    settings: dict[str, object] = {
        "max_local_cpu_size": pool,
        "shm_dir": str(shm_dir),
        "warm_restart": "false",
        "cache_policy": "lru",
        "stats_log_interval_s": 0,
    }
    settings.update(events or {})
    return harness_start_daemon(procs, name, port, settings)


def prompts(n: int, chunks: int, seed: int) -> list[tuple[list[bytes], list[ChunkTokens]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        tokens = [rng.randrange(150_000) for _ in range(chunks * CHUNK_TOKENS)]
        out.append((chunk_keys(tokens, CHUNK_TOKENS), chunk_tokens(tokens, CHUNK_TOKENS)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool-size", default="1GiB")
    parser.add_argument("--chunk-mib", type=float, default=14.0, help="14: Qwen2.5-7B bf16, 256 tokens")
    parser.add_argument("--chunks-per-put", type=int, default=4)
    parser.add_argument("--calls", type=int, default=20, help="puts per timed repetition")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--batch-interval-s", type=float, default=0.05, help="events_batch_interval_s (0.05: the default)"
    )
    parser.add_argument("--events-hwm", type=int, default=16, help="events_hwm (small: the stall drops early)")
    args = parser.parse_args()
    raise_on_sigterm()
    import zmq

    size = int(args.chunk_mib * 2**20)
    per_call = size * args.chunks_per_put
    n = args.warmup + args.calls * args.reps
    work = {"plain": prompts(n, args.chunks_per_put, 1), "events": prompts(n, args.chunks_per_put, 2)}
    payloads = [os.urandom(size) for _ in range(args.chunks_per_put)]
    with workspace("bench-events-") as (procs, workdir):
        shm = Path("/dev/shm") / workdir.name
        for name in ("plain", "events"):
            (shm / name).mkdir(parents=True)
        try:
            plain_port, events_port = free_port(), free_port()
            # ipc: the kernel buffers little of a Unix socket, so the stalled subscriber's
            # queue fills and ZeroMQ drops for it (over loopback TCP megabytes vanish into buffers)
            endpoint = f"ipc://{workdir}/events.sock"
            start_daemon(procs, "plain", plain_port, shm / "plain", args.pool_size, None)
            events_config: dict[str, object] = {
                "events_endpoint": endpoint,
                "events_batch_interval_s": args.batch_interval_s,
                "events_hwm": args.events_hwm,
            }
            start_daemon(procs, "events", events_port, shm / "events", args.pool_size, events_config)
            ctx = zmq.Context()
            stalled = ctx.socket(zmq.SUB)
            stalled.setsockopt(zmq.RCVHWM, 1)
            stalled.setsockopt(zmq.LINGER, 0)
            stalled.setsockopt(zmq.SUBSCRIBE, b"")
            stalled.connect(endpoint)  # and never read
            plain = CacheClient(f"tcp://127.0.0.1:{plain_port}", NAMESPACE, timeout_s=30, fail_open=False)
            events = CacheClient(f"tcp://127.0.0.1:{events_port}", NAMESPACE, timeout_s=30, fail_open=False)
            assert plain.hello()["events"] is None and events.hello()["events"] == {"block_size": 16}
            turn = {"plain": 0, "events": 0}

            def put_plain() -> None:
                keys, _ = work["plain"][turn["plain"]]
                turn["plain"] += 1
                assert all(s == 0 for s in plain.put(keys, payloads)), "a put was not stored"

            def put_events() -> None:
                keys, tokens = work["events"][turn["events"]]
                turn["events"] += 1
                assert all(s == 0 for s in events.put(keys, payloads, tokens=tokens)), "a put was not stored"

            shared = plain.uses_shared_memory and events.uses_shared_memory
            stats = measure_group([(put_plain, None), (put_events, None)], per_call, args.calls, args.reps, args.warmup)
            reached = 0  # what the stalled subscriber has queued: the rest ZeroMQ dropped for it
            while stalled.poll(200):
                stalled.recv_multipart()
                reached += 1
            counters = events.stats()["events"]
            plain.close()
            events.close()
            stalled.close(0)
            ctx.term()
        finally:
            import shutil

            shutil.rmtree(shm, ignore_errors=True)
    base, with_events = stats
    ratio = with_events.median / base.median
    print(
        f"put {args.chunks_per_put} x {args.chunk_mib:g} MiB chunks ({'shared memory' if shared else 'frames'}), "
        f"pool {args.pool_size}, {args.reps} reps of {args.calls} puts"
    )
    print(f"  no events:                     {base.median:8,.0f} MiB/s {base.spread()}")
    print(f"  events + stalled subscriber:   {with_events.median:8,.0f} MiB/s {with_events.spread()}")
    print(f"  ratio: {ratio:.3f}x (target >= 0.95)")
    print(
        f"  events daemon: {counters['announced_chunks']} chunks announced, {counters['removed_chunks']} removed, "
        f"{counters['batches']} batches sent, {counters['dropped_batches']} refused by ZeroMQ, "
        f"{counters['replay_buffered_batches']} kept for replay; the stalled subscriber had {reached} queued "
        f"(the others dropped for it alone)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
