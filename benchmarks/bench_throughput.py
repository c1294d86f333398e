"""Throughput of the lmcache-server daemon against its transport limit, Redis and memcpy.

What is measured (MiB/s of chunk payload, median over repetitions), for chunks of
1, 4, 16 and 32 MiB, always in batches of ``BATCH`` = 8 chunks per request:

``daemon``   ``python -m lmcache_server`` (started here) through the sync
             :class:`lmcache_client.CacheClient`, over tcp and over ipc with
             payload frames (``shared_memory=False``), and over ``shm``: the
             same client mapping the daemon's pool (requests over ipc, bytes
             copied once between the pool and the caller's buffers, copies of
             4 MiB and more split over the client's default ``copy_threads=2``;
             ``shm-1t`` is the same with ``copy_threads=1``, for the
             single-thread comparison).  shm
             get copies into preallocated, already-touched destinations
             (``get_into``, the engine's path), like the memcpy row.  Like
             an engine that has run for a while, the shm client has touched
             every page of its mapping once before timing (untimed warm-up).
             put: 8 chunks under fresh keys per request (a put of a stored key
             is a no-op, so keys are never reused; the pool evicts LRU once
             full, as it would in service); every status must be STORED.
             get: the 8 chunks are put first, then the same 8 keys are read
             again and again; every key must be a hit.
``zmq-echo`` the transport limit: a raw pyzmq DEALER -> ROUTER exchange over
             the same transport with the same socket options.  put: the client
             sends the 8 payload frames, the server answers a tiny ack.  get:
             the client sends a tiny request, the server answers with 8 payload
             frames from preallocated buffers, sent zero-copy.
``redis``    a ``redis-server`` started here on a free port (no persistence,
             ``maxmemory`` = the daemon's pool, allkeys-lru), through redis-py
             with the hiredis parser and the pure-Python serializer (the hiredis
             serializer copies each large value first).  put = MSET of 8 fresh
             keys, get = MGET of 8 keys, over tcp.
``memcpy``   single-thread copy of the same 8 chunks into preallocated,
             already-touched destinations (memoryview slice assignment, i.e.
             memcpy; 8 chunks of 4+ MiB exceed the L3 cache, so this is the
             cache-cold, page-warm copy).  The copy into freshly mmapped
             destinations (page faults included) is printed beside it as
             ``memcpy-fresh`` but is not a row.  memcpy has no direction: its
             one row per size carries op "put", and the table shows it for both.

Fairness: every process that receives large messages (this client, the echo
server, the daemon) runs with :func:`lmcache_client.memtune.tune_malloc`.  All
servers run at once and each (size, op) is measured for every system back to
back, their repetitions interleaved, so drift and bursts of outside load hit
all of them alike.  Before timing, the daemon's pool and Redis are filled once
to their memory limit (untimed), so puts are measured in the steady state of a
full cache rather than while first touching fresh memory.

Each cell: ``--warmup`` untimed requests, then ``--reps`` repetitions of enough
requests to move about ``--rep-mib`` MiB; the table shows the median rate.  A
daemon repetition ends with a ping (timed): the daemon copies a put's payload
into its pool right after answering, and the ping waits for that copy, so the
last put's copy counts in its own repetition instead of slowing whichever
member runs next.
Targets (issue #15), at every measured size, put and get: daemon frames >=
0.85x zmq-echo on the same transport at 4-32 MiB and >= 0.7x at 1 MiB (tcp and
ipc); daemon shm >= 0.8x memcpy at 16-32 MiB, >= 0.6x at 4 MiB, >= 0.35x at
1 MiB.  At ``--target-mib`` (16 by default) also: daemon >= 3x Redis (SET for
put, GET for get) and shm >= 2x the daemon's payload-frame path.

CPU per byte: every cell records the CPU seconds (user + system, all threads)
its server process (daemon, echo server, redis-server) spent per GiB moved; the
table after the figures lists them per path.  On a shared node every daemon
core is taken from the engines.

Diagnostics printed with the figures: the CPU other processes used during the
run (on a 2-core machine anything above ~0.1 core makes the figures noisy), and
per cell the minor page faults per GiB moved in the client and in the server
(262,144 = every 4 KiB page of every buffer faulted in afresh).  Cells whose
receiving side re-faults its buffers are listed: tune_malloc does not reach
the glibc arena of libzmq's I/O thread.  ``--malloc-arena-max 1`` (an
experiment, off by default) sets glibc's M_ARENA_MAX=1 in every process to
show the figures without that cost.

Run: ``python benchmarks/bench_throughput.py [--quick] [--sizes 1,4,16,32] [--json out.json]``
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import logging
import mmap
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import zmq

from lmcache_client import CacheClient
from lmcache_client.client import new_dealer
from lmcache_client.memtune import tune_malloc
from lmcache_client.protocol import PutStatus

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    MIB,
    Child,
    CpuMeter,
    FaultProbe,
    Processes,
    Stats,
    announce_load,
    cpu_seconds,
    filled_buffer,
    free_port,
    limit_malloc_arenas,
    measure_group,
    minor_faults,
    raise_on_sigterm,
    redis_client,
    wait_until,
    workspace,
)

BATCH = 8
NAMESPACE = "bench-throughput"
TRANSPORTS = ("tcp", "ipc")
OPS = ("put", "get")
# Targets of issue #15 per chunk size in MiB (smaller sizes: the 1 MiB one).
ECHO_RATIO_TARGETS = {1: 0.7, 4: 0.85, 16: 0.85, 32: 0.85}
SHM_MEMCPY_TARGETS = {1: 0.35, 4: 0.6, 16: 0.8, 32: 0.8}
SHM_FRAMES_TARGET = 2.0
REDIS_RATIO_TARGET = 3.0
FULL_REFAULT_PER_GIB = 1024**3 // 4096
REFAULT_WARN = 0.1


@dataclasses.dataclass(frozen=True)
class Options:
    sizes_mib: tuple[int, ...]
    reps: int
    warmup: int
    rep_mib: int
    pool_bytes: int
    target_mib: int
    json_path: Path | None
    redis_server: str | None
    profile_daemon: Path | None
    malloc_arena_max: int | None
    shm_put_paths: bool = False


@dataclasses.dataclass(frozen=True)
class Row:
    system: str  # daemon | zmq-echo | redis | memcpy
    transport: str  # tcp | ipc | shm (daemon only) | -
    op: str  # put | get
    size_bytes: int
    stats: Stats

    def as_json(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "transport": self.transport,
            "op": self.op,
            "size_bytes": self.size_bytes,
            "mib_per_s": round(self.stats.median, 1),
            "server_cpu_s_per_gib": None if self.stats.cpu_s_per_gib is None else round(self.stats.cpu_s_per_gib, 4),
        }


class KeyGen:
    """Fresh 32-byte keys, never repeated within one run."""

    def __init__(self) -> None:
        self._counter = itertools.count(1)

    def batch(self, n: int = BATCH) -> list[bytes]:
        return [next(self._counter).to_bytes(32, "big") for _ in range(n)]


class Bench:
    def __init__(self, opts: Options, procs: Processes, workdir: Path):
        self.opts = opts
        self.procs = procs
        self.workdir = workdir
        self.rows: list[Row] = []
        self.notes: list[str] = []
        self.keys = KeyGen()
        max_size = max(opts.sizes_mib) * MIB
        # One set of source chunks; smaller sizes are prefixes of it.
        self.sources = [memoryview(filled_buffer(max_size, i)) for i in range(BATCH)]
        self.endpoints: dict[str, dict[str, str]] = {}
        self.daemon: dict[str, CacheClient] = {}
        self.echo: dict[str, zmq.Socket[Any]] = {}
        self.redis: Any = None
        self.fresh_memcpy: dict[int, Stats] = {}
        self._cell = 0
        self.cpu: CpuMeter | None = None
        self.server_pids: dict[str, int] = {}
        self._cells = len(opts.sizes_mib) * (
            2 + len(OPS) * (2 * len(TRANSPORTS) + 2 + (1 if opts.redis_server else 0)) + opts.shm_put_paths
        )

    # -- setup ---------------------------------------------------------------------------
    def start(self) -> None:
        o = self.opts
        batch_bytes = BATCH * max(o.sizes_mib) * MIB
        if 2 * batch_bytes > o.pool_bytes:
            raise SystemExit(f"--pool-size must hold at least two batches ({2 * batch_bytes >> 20} MiB)")
        for system in ("echo", "daemon"):
            self.endpoints[system] = {
                "tcp": f"tcp://127.0.0.1:{free_port()}",
                "ipc": f"ipc://{self.workdir}/{system}.sock",
            }
        py = sys.executable
        echo = self.procs.start(
            "zmq-echo", [py, str(Path(__file__).resolve().parent / "_harness.py"), "echo-server",
                         *self.endpoints["echo"].values()],
        )  # fmt: skip
        max_message = max(512 * MIB, batch_bytes + MIB)
        daemon_argv = [
            "-m", "lmcache_server",
            "--listen", self.endpoints["daemon"]["tcp"],
            "--listen", self.endpoints["daemon"]["ipc"],
            "--metrics-port", "0",
            "--max-local-cpu-size", f"{o.pool_bytes}B",
            "--set", "malloc_tuning=true",
            "--set", f"max_message_size={max_message}B",
            "--set", f"max_inflight_bytes={max(1024 * MIB, 2 * max_message)}B",
        ]  # fmt: skip
        if o.profile_daemon is not None:
            daemon_argv = ["-m", "cProfile", "-o", str(o.profile_daemon), *daemon_argv]
        daemon = self.procs.start("daemon", [py, *daemon_argv])
        self.server_pids = {"zmq-echo": echo.proc.pid, "daemon": daemon.proc.pid}
        redis_proc: Child | None = None
        redis_port = free_port()
        if o.redis_server:
            redis_proc = self.procs.start(
                "redis",
                [o.redis_server, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.workdir), "--maxmemory", str(o.pool_bytes),
                 "--maxmemory-policy", "allkeys-lru", "--logfile", ""],
            )  # fmt: skip
            self.server_pids["redis"] = redis_proc.proc.pid

        # Clients (zmq contexts and threads) only after every fork above.
        tuned = tune_malloc()
        if o.malloc_arena_max is not None:
            applied = limit_malloc_arenas(o.malloc_arena_max)
            self.notes.append(f"EXPERIMENT: glibc M_ARENA_MAX={o.malloc_arena_max} in every process "
                              f"(bench client: {applied}; children: MALLOC_ARENA_MAX)")  # fmt: skip
        # The client logs "unavailable" once per outage; pings before the daemon is up are expected.
        logging.getLogger("lmcache_client").setLevel(logging.ERROR)
        for transport in TRANSPORTS:
            client = CacheClient(
                self.endpoints["daemon"][transport], NAMESPACE, timeout_s=60, fail_open=False, shared_memory=False
            )
            wait_until(functools.partial(_pings, client), 60, f"daemon on {transport}", daemon.check_alive)
            self.daemon[transport] = client
            sock = new_dealer(zmq.Context.instance(), self.endpoints["echo"][transport], 64)
            sock.setsockopt(zmq.RCVTIMEO, 60_000)
            sock.setsockopt(zmq.SNDTIMEO, 60_000)
            self.echo[transport] = sock
        logging.getLogger("lmcache_client").setLevel(logging.NOTSET)
        for name, threads in (("shm", 2), ("shm-1t", 1)):
            shm_client = CacheClient(
                self.endpoints["daemon"]["ipc"], NAMESPACE, timeout_s=60, fail_open=False, copy_threads=threads
            )
            if not shm_client.uses_shared_memory:
                raise SystemExit(f"the daemon's pool is not shared (see its log):\n{daemon.log_tail(20)}")
            self.daemon[name] = shm_client
        if o.shm_put_paths:  # the put path without staged slots: alloc+commit, two round trips
            self.daemon["shm-alloc"] = CacheClient(
                self.endpoints["daemon"]["ipc"], NAMESPACE, timeout_s=60, fail_open=False, staged_puts=False
            )
        self.echo["tcp"].send(b"hello")
        echo_tuned = self.echo["tcp"].recv() == b"tuned=1"
        echo.check_alive()
        daemon_log = daemon.log_tail(200)
        daemon_tuned = "malloc tuning not applied" not in daemon_log
        self.notes.append(
            f"glibc malloc tuning (lmcache_client.memtune.tune_malloc) applied: bench client={tuned}, "
            f"zmq-echo server={echo_tuned}, daemon={daemon_tuned} (malloc_tuning=true)"
        )
        if redis_proc is not None:
            self.redis = redis_client(redis_port)
            wait_until(lambda: _redis_pings(self.redis), 30, "redis-server", redis_proc.check_alive)
            version = self.redis.info("server").get("redis_version", "?")
            self.notes.append(
                f"redis-server {version} on tcp port {redis_port}: maxmemory={o.pool_bytes >> 20} MiB allkeys-lru, "
                "no persistence; redis-py with hiredis parser + PythonRespSerializer; MSET/MGET of 8"
            )
        self._prime()
        self.cpu = CpuMeter(lambda: [c.proc.pid for c in self.procs.children if c.proc.poll() is None])

    def _prime(self) -> None:
        """Fill the daemon's pool and Redis to their limits once (untimed): steady state."""
        chunk = self.sources[0].nbytes
        calls = -(-self.opts.pool_bytes // (BATCH * chunk)) + 1
        t0 = time.perf_counter()
        client = self.daemon["tcp"]
        for _ in range(calls):
            _expect_stored(client.put(self.keys.batch(), self.sources))
        what = "the daemon's pool"
        if self.redis is not None:
            what += " and redis"
            for _ in range(calls):
                self.redis.mset(dict(zip(self.keys.batch(), self.sources)))
        self.progress(f"primed {what} with {calls * BATCH * chunk >> 20} MiB "
                      f"in {time.perf_counter() - t0:.1f}s (untimed)")  # fmt: skip
        # A long-running engine has touched every page of its mapping of the
        # pool; a fresh one page-faults each on first use.  Warm the shm
        # client's mapping the same way (untimed): one pass over the pool.
        t0 = time.perf_counter()
        for name in ("shm", "shm-1t", *(("shm-alloc",) if self.opts.shm_put_paths else ())):
            for _ in range(calls):
                _expect_stored(self.daemon[name].put(self.keys.batch(), self.sources))
        self.progress(f"warmed the shm client's mapping of the pool in {time.perf_counter() - t0:.1f}s (untimed)")

    # -- running -------------------------------------------------------------------------
    def progress(self, line: str) -> None:
        print(line, flush=True)

    def group(self, op: str, size: int, members: Sequence[tuple[str, str, Callable[[], None]]]) -> list[Stats]:
        """Measure every (system, transport, call) of one (op, size), interleaved."""
        o = self.opts
        batch_bytes = BATCH * size
        calls = max(1, round(o.rep_mib * MIB / batch_bytes))
        probed = [(call, self._fault_probe(system)) for system, _, call in members]
        names = ", ".join(f"{system} {transport}".rstrip(" -") for system, transport, _ in members)
        self.progress(f"measuring {op} {size >> 20} MiB x{BATCH}: {names} (interleaved) ...")
        # A daemon answers a put before copying it into the pool: a ping at the end
        # of each repetition (timed) charges that copy to the put's own figure.
        settles = [self.daemon[t].ping if system == "daemon" else None for system, t, _ in members]
        cpu_probes = [self._cpu_probe(system) for system, _, _ in members]
        results = measure_group(probed, batch_bytes, calls, o.reps, o.warmup, settles, cpu_probes)
        for (system, transport, _), stats in zip(members, results):
            self._cell += 1
            if system != "memcpy-fresh":
                self.rows.append(Row(system, transport, op, size, stats))
            client_faults, server_faults = stats.faults_per_gib
            cpu = "" if stats.cpu_s_per_gib is None else f"; server CPU {stats.cpu_s_per_gib:.3f} s/GiB"
            self.progress(
                f"[{self._cell:2d}/{self._cells}] {system:12s} {transport:3s} {op} {size >> 20:3d} MiB x{BATCH}: "
                f"{stats.median:8,.0f} MiB/s {stats.spread():17s} ({o.reps} reps x {calls} requests; "
                f"page faults/GiB client {client_faults:,.0f} server {server_faults:,.0f}{cpu})"
            )
        return results

    def _cpu_probe(self, system: str) -> Callable[[], float] | None:
        server = self.server_pids.get(system)
        return (lambda: cpu_seconds(server)) if server else None

    def _fault_probe(self, system: str) -> FaultProbe:
        server = self.server_pids.get(system)
        return lambda: (minor_faults(None), minor_faults(server) if server else 0)

    def run(self) -> None:
        for size_mib in self.opts.sizes_mib:
            self.run_memcpy(size_mib * MIB)
        for size_mib in self.opts.sizes_mib:
            size = size_mib * MIB
            payloads = [s[:size] for s in self.sources]
            for op in OPS:
                members = []
                for transport in TRANSPORTS:
                    members.append(("zmq-echo", transport, self.echo_call(transport, op, payloads)))
                    members.append(("daemon", transport, self.daemon_call(transport, op, payloads)))
                members.append(("daemon", "shm", self.daemon_call("shm", op, payloads)))
                members.append(("daemon", "shm-1t", self.daemon_call("shm-1t", op, payloads)))
                if op == "put" and self.opts.shm_put_paths:
                    members.append(("daemon", "shm-alloc", self.daemon_call("shm-alloc", op, payloads)))
                if self.redis is not None:
                    members.append(("redis", "tcp", self.redis_call(op, payloads)))
                self.group(op, size, members)

    def run_memcpy(self, size: int) -> None:
        """One "memcpy" row (reused, already-touched destinations); fresh ones printed beside it."""
        src = [s[:size] for s in self.sources]
        dst = [memoryview(filled_buffer(size, 99)) for _ in range(BATCH)]

        def reused() -> None:
            for d, s in zip(dst, src):
                d[:] = s

        def fresh() -> None:
            for s in src:
                with mmap.mmap(-1, size) as m:
                    memoryview(m)[:] = s

        self.fresh_memcpy[size] = self.group("put", size, [("memcpy", "-", reused), ("memcpy-fresh", "-", fresh)])[1]

    def daemon_call(self, transport: str, op: str, payloads: list[memoryview]) -> Callable[[], None]:
        client = self.daemon[transport]
        size = payloads[0].nbytes
        if op == "put":
            return lambda: _expect_stored(client.put(self.keys.batch(), payloads))
        keys = self.keys.batch()
        _expect_stored(client.put(keys, payloads))
        # Read once now: under lfuda the last chunk of a put that was never read
        # is the first victim, and the other members' set-up puts come next.
        if not all(b is not None for b in client.get(keys)):
            raise AssertionError("daemon get missed right after the put")
        if transport.startswith("shm"):
            out = [memoryview(filled_buffer(size, 98)) for _ in keys]

            def get_into() -> None:
                hits = client.get_into(keys, out)
                if not all(hits):
                    raise AssertionError(f"daemon shm get missed: {hits}")

            return get_into

        def get() -> None:
            bufs = client.get(keys)
            if any(b is None or memoryview(b).nbytes != size for b in bufs):
                raise AssertionError(f"daemon get missed: {[b is not None for b in bufs]}")

        return get

    def echo_call(self, transport: str, op: str, payloads: list[memoryview]) -> Callable[[], None]:
        sock = self.echo[transport]
        if op == "put":

            def put() -> None:
                sock.send_multipart([b"put", *payloads], copy=False)
                if sock.recv() != b"ok":
                    raise AssertionError("echo put not acknowledged")

            return put
        request = b"get %d %d" % (payloads[0].nbytes, BATCH)

        def get() -> None:
            sock.send(request)
            frames = sock.recv_multipart(copy=False)
            if len(frames) != BATCH + 1:
                raise AssertionError(f"echo get returned {len(frames)} frames")

        return get

    def redis_call(self, op: str, payloads: list[memoryview]) -> Callable[[], None]:
        r = self.redis
        size = payloads[0].nbytes
        if op == "put":

            def put() -> None:
                if not r.mset(dict(zip(self.keys.batch(), payloads))):
                    raise AssertionError("redis MSET failed")

            return put
        keys = self.keys.batch()
        r.mset(dict(zip(keys, payloads)))

        def get() -> None:
            values = r.mget(keys)
            if any(v is None or len(v) != size for v in values):
                raise AssertionError(f"redis MGET missed: {[v is not None for v in values]}")

        return get

    def close(self) -> None:
        for sock in self.echo.values():
            sock.close(linger=0)
        for client in self.daemon.values():
            client.close()
        if self.redis is not None:
            self.redis.close()

    # -- report --------------------------------------------------------------------------
    def _refaulted_cells(self) -> list[str]:
        """zmq cells whose receiving process (server for put, client for get) page-faulted its buffers."""
        out = []
        for row in self.rows:
            if row.system in ("zmq-echo", "daemon"):
                receiver = row.stats.faults_per_gib[1 if row.op == "put" else 0]
                if receiver > REFAULT_WARN * FULL_REFAULT_PER_GIB:
                    out.append(f"{row.system} {row.transport} {row.op} {row.size_bytes >> 20} MiB "
                               f"({receiver / FULL_REFAULT_PER_GIB:.0%})")  # fmt: skip
        return out

    def rate(self, system: str, transport: str, op: str, size: int) -> float | None:
        for row in self.rows:
            if (row.system, row.transport, row.op, row.size_bytes) == (system, transport, op, size):
                return row.stats.median
        return None

    def report(self) -> bool | None:
        """Print the table and the targets; True if every target passed (None: not evaluated)."""
        print()
        if self.cpu is not None:
            outside = self.cpu.outside_load()
            warn = "  WARNING: the figures are noisy; rerun on a quiet machine" if outside > 0.1 else ""
            self.notes.append(f"CPU used by other processes while measuring: {outside:.2f} cores{warn}")
        refaulted = self._refaulted_cells()
        if refaulted:
            self.notes.append(
                f"receive buffers were page-faulted in again (> {REFAULT_WARN:.0%} of the bytes received) in "
                f"{len(refaulted)} zmq cells: {', '.join(refaulted)}.  tune_malloc keeps the main arena's memory, "
                "but libzmq's I/O thread allocates from its own glibc arena, whose heaps are unmapped when "
                "emptied; rerun with --malloc-arena-max 1 for the figures without that cost"
            )
        for note in self.notes:
            print(f"note: {note}")
        has_redis = self.redis is not None
        head = f"{'op':3s} {'size':>6s} {'memcpy':>8s} {'shm-1t':>7s} {'shm':>7s} {'shm/cpy':>7s} {'shm/ipc':>7s}"
        for t in TRANSPORTS:
            head += f" | {'echo-' + t:>9s} {'daemon-' + t:>10s} {'d/echo':>6s}"
        if has_redis:
            head += f" | {'redis':>7s} " + " ".join(f"{'d-' + t + '/redis':>12s}" for t in TRANSPORTS)
        print(f"\nMiB/s, median of {self.opts.reps} repetitions; {BATCH} chunks per request")
        print(head)
        print("-" * len(head))
        for op in OPS:
            for size_mib in self.opts.sizes_mib:
                size = size_mib * MIB
                memcpy, shm = self.rate("memcpy", "-", "put", size), self.rate("daemon", "shm", op, size)
                one = self.rate("daemon", "shm-1t", op, size)
                line = f"{op:3s} {size_mib:3d} MiB {_fmt(memcpy):>8s} {_fmt(one):>7s} {_fmt(shm):>7s}"
                line += f" {_ratio(shm, memcpy):>7s}"
                line += f" {_ratio(shm, self.rate('daemon', 'ipc', op, size)):>7s}"
                redis = self.rate("redis", "tcp", op, size)
                for t in TRANSPORTS:
                    echo, daemon = self.rate("zmq-echo", t, op, size), self.rate("daemon", t, op, size)
                    line += f" | {_fmt(echo):>9s} {_fmt(daemon):>10s} {_ratio(daemon, echo):>6s}"
                if has_redis:
                    line += f" | {_fmt(redis):>7s} " + " ".join(
                        f"{_ratio(self.rate('daemon', t, op, size), redis):>12s}" for t in TRANSPORTS
                    )
                print(line)
        if self.opts.shm_put_paths:
            print("shm put, staged slots (one bind per put) vs alloc+commit (two round trips), same run:")
            for size_mib in self.opts.sizes_mib:
                size = size_mib * MIB
                memcpy = self.rate("memcpy", "-", "put", size)
                staged, alloc = self.rate("daemon", "shm", "put", size), self.rate("daemon", "shm-alloc", "put", size)
                print(f"  {size_mib:3d} MiB x{BATCH}: staged {_fmt(staged)} MiB/s = {_ratio(staged, memcpy)} memcpy, "
                      f"alloc+commit {_fmt(alloc)} MiB/s = {_ratio(alloc, memcpy)} memcpy; "
                      f"staged/alloc {_ratio(staged, alloc)}")  # fmt: skip
        fresh = ", ".join(f"{s >> 20} MiB {v.median:,.0f}" for s, v in sorted(self.fresh_memcpy.items()))
        print(f"memcpy-fresh (into a freshly mmapped destination, page faults included), MiB/s: {fresh}")
        return self.targets()

    def cpu_table(self) -> None:
        """Server CPU seconds per GiB moved, per system and path: on a shared node every
        daemon core is taken from the engines."""
        print("\nserver CPU seconds per GiB moved (user + system, all threads of the server process)")
        systems = [("daemon", t) for t in (*TRANSPORTS, "shm", "shm-1t")] + [("zmq-echo", t) for t in TRANSPORTS]
        if self.redis is not None:
            systems.append(("redis", "tcp"))
        print(f"{'op':3s} {'size':>6s} " + " ".join(f"{(s + ' ' + t):>14s}" for s, t in systems))
        for op in OPS:
            for size_mib in self.opts.sizes_mib:
                cells = []
                for system, transport in systems:
                    row = next((r for r in self.rows if (r.system, r.transport, r.op, r.size_bytes)
                                == (system, transport, op, size_mib * MIB)), None)  # fmt: skip
                    cpu = None if row is None else row.stats.cpu_s_per_gib
                    cells.append("-" if cpu is None else f"{cpu:.3f}")
                print(f"{op:3s} {size_mib:3d} MiB " + " ".join(f"{c:>14s}" for c in cells))

    def targets(self) -> bool | None:
        """Issue #15's targets at every measured size, and the Redis and shm-vs-frames
        ones at ``--target-mib``."""
        self.cpu_table()
        print("\ntargets:")
        ok = True
        for size_mib in self.opts.sizes_mib:
            size = size_mib * MIB
            echo_want = _target_for(ECHO_RATIO_TARGETS, size_mib)
            shm_want = _target_for(SHM_MEMCPY_TARGETS, size_mib)
            memcpy = self.rate("memcpy", "-", "put", size)
            for op in OPS:
                for t in TRANSPORTS:
                    daemon, echo = self.rate("daemon", t, op, size), self.rate("zmq-echo", t, op, size)
                    ok &= _check(f"daemon {t} {op} {size_mib} MiB", daemon, "zmq-echo " + t, echo, echo_want)
                shm = self.rate("daemon", "shm", op, size)
                ok &= _check(f"daemon shm {op} {size_mib} MiB", shm, "memcpy", memcpy, shm_want)
                if size_mib == self.opts.target_mib:
                    redis = self.rate("redis", "tcp", op, size)
                    if redis is not None:
                        for t in TRANSPORTS:
                            daemon = self.rate("daemon", t, op, size)
                            name = "redis " + ("GET" if op == "get" else "SET")
                            ok &= _check(f"daemon {t} {op} {size_mib} MiB", daemon, name, redis, REDIS_RATIO_TARGET)
                    for t in TRANSPORTS:
                        frames = self.rate("daemon", t, op, size)
                        ok &= _check(f"daemon shm {op} {size_mib} MiB", shm, f"daemon {t} frames", frames,
                                     SHM_FRAMES_TARGET)  # fmt: skip
                    one = self.rate("daemon", "shm-1t", op, size)
                    print(f"  info  daemon shm {op} {size_mib} MiB with copy_threads=1: {_fmt(one)} MiB/s = "
                          f"{_ratio(one, memcpy)} memcpy, "
                          f"{_ratio(one, self.rate('daemon', 'ipc', op, size))} daemon ipc frames")  # fmt: skip
        return ok

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps([r.as_json() for r in self.rows], indent=1) + "\n")
        print(f"wrote {len(self.rows)} rows to {path}")


def _pings(client: CacheClient) -> bool:
    try:
        client.ping(timeout_s=0.5)
        return True
    except Exception:
        return False


def _redis_pings(r: Any) -> bool:
    try:
        return bool(r.ping())
    except Exception:
        return False


def _expect_stored(statuses: Sequence[PutStatus]) -> None:
    if any(s != PutStatus.STORED for s in statuses):
        raise AssertionError(f"daemon put not stored: {[PutStatus(s).name for s in statuses]}")


def _check(what: str, value: float | None, name: str, base: float | None, want: float) -> bool:
    ratio = value / base if value and base else 0.0
    passed = ratio >= want
    print(f"  {'PASS' if passed else 'MISS'}  {what}: {_fmt(value)} MiB/s = "
          f"{ratio:.2f}x {name} ({_fmt(base)} MiB/s), target >= {want}x")  # fmt: skip
    return passed


def _target_for(targets: dict[int, float], size_mib: int) -> float:
    """The target of the largest listed size not above ``size_mib`` (the smallest one below it)."""
    fitting = [k for k in targets if k <= size_mib]
    return targets[max(fitting)] if fitting else targets[min(targets)]


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _ratio(num: float | None, den: float | None) -> str:
    return "-" if not num or not den else f"{num / den:.2f}x"


def _parse_args(argv: Sequence[str] | None) -> Options:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--sizes", default="1,4,16,32", help="chunk sizes in MiB, comma-separated (default 1,4,16,32)")
    p.add_argument("--quick", action="store_true", help="short run: 3 reps, 1 warm-up, ~64 MiB per rep")
    p.add_argument("--reps", type=int, help="timed repetitions per cell (default 9; quick: 3)")
    p.add_argument("--warmup", type=int, help="untimed requests per cell (default 2; quick: 1)")
    p.add_argument("--rep-mib", type=int, help="MiB moved per repetition, at least one request (default 1024)")
    p.add_argument("--pool-size", default="4GiB", help="daemon pool and redis maxmemory (default 4GiB)")
    p.add_argument("--target-mib", type=int, default=16, help="chunk size the targets are checked at (default 16)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--redis-server", default=shutil.which("redis-server"), help="redis-server binary ('' to skip)")
    p.add_argument(
        "--profile-daemon", type=Path, metavar="PATH", help="run the daemon under cProfile, writing its stats to PATH"
    )
    p.add_argument("--malloc-arena-max", type=int, metavar="N",
                   help="experiment: glibc M_ARENA_MAX=N in every process (client, echo server, daemon); "
                        "1 keeps libzmq's I/O-thread receive buffers in the main arena")  # fmt: skip
    p.add_argument("--shm-put-paths", action="store_true",
                   help="also measure shm put without staged slots (alloc+commit: shm-alloc), same run")  # fmt: skip
    a = p.parse_args(argv)
    from lmcache_server.config import parse_size  # the daemon's own size syntax

    sizes = tuple(int(s) for s in a.sizes.split(",") if s.strip())
    if not sizes or min(sizes) < 1:
        p.error("--sizes needs positive integers")
    return Options(
        sizes_mib=sizes,
        reps=a.reps or (3 if a.quick else 9),
        warmup=a.warmup if a.warmup is not None else (1 if a.quick else 2),
        rep_mib=a.rep_mib or (64 if a.quick else 1024),
        pool_bytes=parse_size(a.pool_size),
        target_mib=a.target_mib,
        json_path=a.json,
        redis_server=a.redis_server or None,
        profile_daemon=a.profile_daemon.resolve() if a.profile_daemon else None,
        malloc_arena_max=a.malloc_arena_max,
        shm_put_paths=a.shm_put_paths,
    )


def main(argv: Sequence[str] | None = None) -> int:
    opts = _parse_args(argv)
    raise_on_sigterm()
    started = time.perf_counter()
    announce_load()
    env = None
    if opts.malloc_arena_max is not None:
        env = {**os.environ, "MALLOC_ARENA_MAX": str(opts.malloc_arena_max)}
    with workspace("lmcache-bench-", env) as (procs, workdir):
        bench: Bench | None = None
        try:
            bench = Bench(opts, procs, workdir)
            bench.start()
            bench.run()
            passed = bench.report()
            if opts.json_path is not None:
                bench.write_json(opts.json_path)
            verdict = "not evaluated" if passed is None else "all PASS" if passed else "MISSED"
            print(f"\ntotal {time.perf_counter() - started:.0f}s; targets {verdict}")
            return 0
        except KeyboardInterrupt:
            print("\ninterrupted; stopping the servers", file=sys.stderr)
            return 130
        finally:
            if bench is not None:
                bench.close()


if __name__ == "__main__":
    sys.exit(main())
