"""Mooncake Store as the shared remote tier: the raw engine, Redis, and the daemon on each.

Two nodes are played on one host: node A stores, node B reads what A stored.
Everything is measured in one run, the systems' repetitions interleaved (rep i of
every system before rep i+1 of any), so drift and outside load hit all alike.

(a) Throughput (MiB/s of chunk payload, median over ``--reps`` repetitions) of
chunks of 1, 4, 16 and 32 MiB, ``BATCH`` = 8 chunks per request, about
``--rep-mib`` MiB of fresh keys per repetition:

``mc-raw``     Mooncake Store's Python client (``MooncakeDistributedStore``,
               TCP transport), the bytes API: ``put_batch`` from one client
               process (node A), ``get_batch`` from another (node B), each
               mounting its own segment on one ``mooncake_master`` (started
               here, with its HTTP metadata server).
``mc-raw-zc``  the same two processes, the zero-copy API: ``batch_put_from``
               and ``batch_get_into`` on buffers registered with the client
               (``register_buffer``), the engine's best path.  In these two the
               master places each value in a segment of its choice, as it does
               for the daemons: about half land in node B's own segment, and
               B's get of those is a local copy, not a network transfer.
``mc-zc-far``  the zero-copy API with every value put into node A's segment
               (``ReplicateConfig.preferred_segment``): every get of node B
               crosses TCP, like every Redis get does (and every put is a
               copy into A's own memory, which no other system's put is).
``redis-raw``  a redis-server started here (free port, temp dir, no
               persistence), redis-py with the hiredis parser and the
               pure-Python serializer (``_harness.redis_client``): MSET of 8
               on one connection (node A), MGET of 8 on another (node B).
``ours-mc``    two lmcache-server daemons (this checkout's ``python -m
               lmcache_server --config FILE``) with ``remote_url:
               mooncake://...`` on a second master, each mounting its own
               segment.  put: the client of node A puts the chunks (same host:
               through A's shared pool, as an engine beside its daemon does)
               and the clock runs until A's write-behind has flushed them: A's
               ``stats`` show the tier's ``stores`` counter up by the number of
               chunks and its queue (``queued_writes``) empty.  get: the client
               of node B gets each chunk once; B's memory tier never held them
               (fresh keys), so every get is read from the remote tier (B's
               tier ``hits`` counter is checked to have risen by every chunk).
``ours-redis`` the same two daemons' setup with ``remote_url: redis://`` on the
               redis-server above.

After each repetition its keys are removed (untimed) from every system.  Ratios
(per op and size): ``ours-mc / mc-raw-zc`` and ``ours-mc / mc-raw`` (our
overhead on top of the engine), ``mc-raw-zc / redis-raw`` (Mooncake against
Redis, both raw; ``mc-zc-far / redis-raw`` with every byte over TCP),
``ours-mc / ours-redis``, ``ours-redis / redis-raw``.  ``put (acked)`` rates,
until the daemon answered STORED (before the write-behind), are printed
beside.  Where Mooncake's master placed the values is printed as the share of
node B's gets whose value was in B's own segment (for the daemons, asked by a
probe client on their master, with no segment of its own, between put and get).

(b) Cross-node hit latency for a 1,000-token prompt (``--prompt-tokens``) in a
small model's KV layout (``--kv-model``, default Llama-3.2-1B: 16 layers, 8 KV
heads, head dim 64, bfloat16 = 32 KiB a token; 256-token chunks, the daemon's
default ``chunk_size``: 3 chunks of 8 MiB and a 232-token tail of 7.25 MiB under
the keys ``lmcache_client.keys.prompt_keys`` gives).  Each repetition takes a
fresh random prompt, so B's memory never holds it: node A stores its chunks and
(untimed) waits until they are in the remote tier; then node B's client does
``lookup`` (all must hit) and ``get`` of the prompt's keys, timed.  Reported:
median (and p90) of ``--prompt-reps`` repetitions of B's lookup, get and
lookup+get, for ours on Mooncake and on Redis, and for the raw clients beside
(``batch_is_exist`` + the get of each API above; EXISTS + MGET).

Mooncake needs the package ``mooncake-transfer-engine-non-cuda`` (its
``mooncake_master`` console script beside the interpreter, or ``--mooncake-master``)
and the system library libibverbs1.  Noise: the CPU that other processes used
during the run is printed (on 2 cores anything above ~0.1 core makes the figures
noisy).

Run: ``.venv/bin/python benchmarks/bench_mooncake.py [--quick] [--out FILE.json]``
(``--systems`` picks a subset, ``--no-throughput`` / ``--no-prompt`` a part).  The
full run (9 repetitions of 512 MiB per cell, 20 prompts) takes about 4 minutes on
2 cores and up to about 11 GiB of memory (pools, segments, buffers, Redis);
``--quick`` (2 of 64 MiB, 5 prompts) about 30 s.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import hashlib
import json
import logging
import mmap
import os
import random
import select
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    MIB,
    Child,
    CpuMeter,
    Processes,
    announce_load,
    filled_buffer,
    free_port,
    percentile,
    raise_on_sigterm,
    redis_client,
    wait_until,
    workspace,
)

from lmcache_client.memtune import tune_malloc  # noqa: E402

BATCH = 8
REPO = Path(__file__).resolve().parent.parent
NAMESPACE = "bench-mooncake"
SYSTEMS = ("mc-raw", "mc-raw-zc", "mc-zc-far", "redis-raw", "ours-mc", "ours-redis")
OPS = ("put", "get")
CHUNK_TOKENS = 256  # the daemon's default chunk_size
# name: (model id, layers, KV heads, head dim); bfloat16 KV
KV_MODELS = {
    "qwen2.5-0.5b": ("Qwen/Qwen2.5-0.5B-Instruct", 24, 2, 64),
    "llama-3.2-1b": ("meta-llama/Llama-3.2-1B-Instruct", 16, 8, 64),
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B-Instruct", 32, 8, 128),
}
STATS_POLL_S = 0.002
FLUSH_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class Options:
    sizes_mib: tuple[int, ...]
    reps: int
    rep_mib: int
    warmup: bool
    systems: tuple[str, ...]
    throughput: bool
    prompt: bool
    prompt_tokens: int
    prompt_reps: int
    kv_model: str
    out: Path | None
    redis_server: str
    mooncake_master: str
    mooncake_python: str

    @property
    def max_chunk(self) -> int:
        return max(self.sizes_mib) * MIB

    @property
    def rep_bytes(self) -> int:
        return max(self.rep_mib * MIB, BATCH * self.max_chunk)


def _chunks_per_rep(opts: Options, size: int) -> int:
    n = max(BATCH, opts.rep_mib * MIB // size)
    return -(-n // BATCH) * BATCH


# -- the Mooncake worker (a separate process: node A or node B) ---------------------------
def worker_main() -> int:
    """``python bench_mooncake.py mooncake-worker``: one MooncakeDistributedStore;
    one JSON request per line on stdin, one JSON reply per line on stdout."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the C++ library prints goes to the log, not into the replies
    worker = _Worker()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            reply = worker.handle(req)
        except Exception as err:  # reported by the bench process
            reply = {"error": f"{type(err).__name__}: {err}"}
        replies.write(json.dumps(reply) + "\n")
    return 0


class _Worker:
    def __init__(self) -> None:
        self.store: Any = None
        self.hostname = ""
        self.slot = 0
        self.src: mmap.mmap | None = None
        self.dst: mmap.mmap | None = None
        self.src_ptr = self.dst_ptr = 0
        self.configs: dict[str, Any] = {}

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req["op"]
        if op == "setup":
            return self.setup(req)
        keys: list[str] = req.get("keys", [])
        sizes: list[int] = req.get("sizes", [])
        if op == "put":
            return {"s": self.put(keys, sizes, req["api"], self.configs[req.get("prefer", "")])}
        if op == "get":
            return {"s": self.get(keys, sizes, req["api"], req.get("verify", False))}
        if op == "lookup_get":
            t0 = time.perf_counter()
            found = self.store.batch_is_exist(keys)
            t1 = time.perf_counter()
            if list(found) != [1] * len(keys):
                raise RuntimeError(f"batch_is_exist: {found}")
            self.get(keys, sizes, req["api"], False)
            return {"lookup_s": t1 - t0, "get_s": time.perf_counter() - t1}
        if op == "where":
            local = 0
            for key in keys:
                replicas = self.store.get_replica_desc(key)
                ends = [r.get_memory_descriptor().buffer_descriptor.transport_endpoint
                        for r in replicas if r.is_memory_replica()]  # fmt: skip
                local += req.get("holder", self.hostname) in ends
            return {"local": local, "n": len(keys)}
        if op == "remove":
            self.store.batch_remove(keys, True)  # force: a value read a moment ago is still leased
            return {}
        raise ValueError(f"unknown op {op!r}")

    def setup(self, req: dict[str, Any]) -> dict[str, Any]:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        from lmcache_client.memtune import tune_malloc

        tuned = tune_malloc()  # as the daemons (malloc_tuning: true) and the bench process run
        self.hostname = req["hostname"]

        self.configs = {"": ReplicateConfig()}
        self.configs[self.hostname] = ReplicateConfig()
        self.configs[self.hostname].preferred_segment = self.hostname  # into this client's own segment
        self.slot = req["slot"]
        size = BATCH * self.slot
        self.src, self.dst = mmap.mmap(-1, size), mmap.mmap(-1, size)
        for i in range(BATCH):  # the same bytes the bench process puts through the others
            self.src[i * self.slot : (i + 1) * self.slot] = filled_buffer(self.slot, i)
        self.dst.write(b"\1" * size)  # touched, like the bench's destinations
        self.src_ptr = ctypes.addressof(ctypes.c_char.from_buffer(self.src))
        self.dst_ptr = ctypes.addressof(ctypes.c_char.from_buffer(self.dst))
        self.store = MooncakeDistributedStore()
        t0 = time.perf_counter()
        rc = self.store.setup(self.hostname, req["metadata"], req["segment"], req["buffer"], "tcp", "", req["master"])
        if rc != 0:
            raise RuntimeError(f"setup returned {rc}")
        setup_s = time.perf_counter() - t0
        for ptr in (self.src_ptr, self.dst_ptr):
            rc = self.store.register_buffer(ptr, size)
            if rc != 0:
                raise RuntimeError(f"register_buffer returned {rc}")
        return {"setup_s": setup_s, "tuned": tuned}

    def put(self, keys: list[str], sizes: list[int], api: str, config: Any) -> float:
        assert self.src is not None
        view = memoryview(self.src)
        t0 = time.perf_counter()
        for i in range(0, len(keys), BATCH):
            ks, ss = keys[i : i + BATCH], sizes[i : i + BATCH]
            if api == "bytes":
                values = [view[j * self.slot : j * self.slot + s] for j, s in enumerate(ss)]
                rc = self.store.put_batch(ks, values, config)
                if rc != 0:
                    raise RuntimeError(f"put_batch returned {rc}")
            else:
                ptrs = [self.src_ptr + j * self.slot for j in range(len(ks))]
                rcs = self.store.batch_put_from(ks, ptrs, ss, config)
                if any(rc != 0 for rc in rcs):
                    raise RuntimeError(f"batch_put_from returned {rcs}")
        return time.perf_counter() - t0

    def get(self, keys: list[str], sizes: list[int], api: str, verify: bool) -> float:
        assert self.src is not None and self.dst is not None
        total = 0.0
        for i in range(0, len(keys), BATCH):
            ks, ss = keys[i : i + BATCH], sizes[i : i + BATCH]
            t0 = time.perf_counter()
            if api == "bytes":
                values = self.store.get_batch(ks)
                total += time.perf_counter() - t0
                if [len(v) for v in values] != ss:
                    raise RuntimeError(f"get_batch sizes {[len(v) for v in values]}, expected {ss}")
            else:
                got = self.store.batch_get_into(ks, [self.dst_ptr + j * self.slot for j in range(len(ks))], ss)
                total += time.perf_counter() - t0
                if list(got) != ss:
                    raise RuntimeError(f"batch_get_into returned {got}, expected {ss}")
                values = [self.dst[j * self.slot : j * self.slot + s] for j, s in enumerate(ss)]
            if verify:
                for j, (v, s) in enumerate(zip(values, ss)):
                    if bytes(v) != self.src[j * self.slot : j * self.slot + s]:
                        raise RuntimeError(f"{ks[j]}: wrong bytes")
        return total


class MooncakeClientProcess:
    """A worker process (one Mooncake client with its own segment), driven over pipes."""

    def __init__(self, procs: Processes, name: str, python: str):
        self.child: Child = procs.start_piped(name, [python, str(Path(__file__).resolve()), "mooncake-worker"])
        self.name = name
        self.hostname = f"127.0.0.1:{free_port()}"

    def call(self, timeout_s: float = 300.0, **req: Any) -> dict[str, Any]:
        proc = self.child.proc
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(req).encode() + b"\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline() if ready else b""
        if not line:
            self.child.check_alive()
            raise TimeoutError(f"{self.name}: no answer to {req['op']} within {timeout_s:.0f}s")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.name} {req['op']}: {reply['error']}; log tail:\n{self.child.log_tail(10)}")
        return reply


@dataclasses.dataclass
class Master:
    name: str
    child: Child
    rpc: str
    metadata: str


def start_master(procs: Processes, opts: Options, name: str, workdir: Path) -> Master:
    rpc, http, metrics = free_port(), free_port(), free_port()
    child = procs.start(name, [
        opts.mooncake_master, f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
        f"--http_metadata_server_port={http}", "--http_metadata_server_host=127.0.0.1",
        f"--metrics_port={metrics}",
    ], cwd=workdir)  # fmt: skip
    for port in (rpc, http):
        wait_until(lambda p=port: _listening(p), 30, f"{name} port {port}", child.check_alive)  # type: ignore[misc]
    return Master(name, child, f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata")


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


# -- the daemons -----------------------------------------------------------------------
class Node:
    """One lmcache-server daemon (this checkout's code) and the bench's client of it."""

    def __init__(self, procs: Processes, workdir: Path, name: str, tier: str, settings: dict[str, Any]):
        from lmcache_client import CacheClient

        self.name, self.tier = name, tier
        self.settings = settings
        home = workdir / name
        home.mkdir()
        self.ipc = f"ipc://{home}/lmcache.sock"
        config = {
            "listen": [f"tcp://127.0.0.1:{free_port()}", self.ipc],
            "metrics_port": 0,
            "state_dir": str(home / "state"),
            "warm_restart": False,
            "stats_log_interval_s": 0,
            "malloc_tuning": True,
            **settings,
        }
        path = home / "server.yaml"
        path.write_text(json.dumps(config, indent=1))  # JSON is YAML
        self.child = procs.start(name, [sys.executable, "-m", "lmcache_server", "--config", str(path)], cwd=REPO)
        logging.getLogger("lmcache_client").setLevel(logging.ERROR)  # pings before it is up are expected
        self.client = CacheClient(self.ipc, NAMESPACE, timeout_s=120, fail_open=False)
        wait_until(self._pings, 60, f"{name} to answer", self.child.check_alive)
        logging.getLogger("lmcache_client").setLevel(logging.NOTSET)
        wait_until(lambda: bool(self.tier_stats().get("up")), 60, f"{name}'s {tier} tier up", self.child.check_alive)
        if not self.client.uses_shared_memory:
            raise SystemExit(f"{name}: the pool is not shared (see its log):\n{self.child.log_tail(20)}")

    def _pings(self) -> bool:
        try:
            self.client.ping(timeout_s=0.5)
            return True
        except Exception:
            return False

    def tier_stats(self) -> dict[str, Any]:
        tiers: dict[str, Any] = self.client.stats()["tiers"]
        if self.tier not in tiers:
            raise SystemExit(f"{self.name} has no {self.tier!r} tier; its tiers: {sorted(tiers)}")
        return dict(tiers[self.tier])

    def wait_flushed(self, stores_before: int, n: int) -> dict[str, Any]:
        """Poll until the tier acknowledged ``n`` more stores and its queue is empty."""
        deadline = time.monotonic() + FLUSH_TIMEOUT_S
        while True:
            s = self.tier_stats()
            if s["stores"] >= stores_before + n and not s.get("queued_writes"):
                return s
            if s.get("dropped_writes"):
                raise RuntimeError(f"{self.name}: {s['dropped_writes']} writes to {self.tier} dropped: {s}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: write-behind not flushed: {s}")
            self.child.check_alive()
            time.sleep(STATS_POLL_S)

    def wait_idle(self) -> None:
        """Until the tier owes nothing (writes, removals): the next repetition starts clean."""
        wait_until(lambda: not (s := self.tier_stats()).get("queued_writes") and not s.get("pending_removals"),
                   FLUSH_TIMEOUT_S, f"{self.name} idle", self.child.check_alive)  # fmt: skip

    def close(self) -> None:
        self.client.close()


# -- the systems -----------------------------------------------------------------------
@dataclasses.dataclass
class Sample:
    put_s: float
    get_s: float
    put_ack_s: float | None = None
    local_share: float | None = None  # share of B's gets whose value was in B's own segment


class System:
    name = ""

    def run(self, tag: str, size: int, n: int, verify: bool) -> Sample:
        raise NotImplementedError

    def prompt(self, tag: str, sizes: list[int], keys: list[bytes], namespace: str) -> tuple[float, float]:
        """Node A stores a prompt's chunks (untimed, until they are in the remote tier);
        node B's (lookup, get) seconds."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class MooncakeRaw(System):
    def __init__(self, a: MooncakeClientProcess, b: MooncakeClientProcess, api: str, far: bool = False):
        self.a, self.b, self.api = a, b, api
        self.name = "mc-raw" if api == "bytes" else "mc-zc-far" if far else "mc-raw-zc"
        self.prefer = a.hostname if far else ""  # far: every value in node A's segment

    def run(self, tag: str, size: int, n: int, verify: bool) -> Sample:
        keys = [f"{self.name}/{tag}/{i}" for i in range(n)]
        sizes = [size] * n
        put_s = self.a.call(op="put", keys=keys, sizes=sizes, api=self.api, prefer=self.prefer)["s"]
        where = self.b.call(op="where", keys=keys)
        get_s = self.b.call(op="get", keys=keys, sizes=sizes, api=self.api, verify=verify)["s"]
        self.a.call(op="remove", keys=keys)
        return Sample(put_s, get_s, local_share=where["local"] / where["n"])

    def prompt(self, tag: str, sizes: list[int], keys: list[bytes], namespace: str) -> tuple[float, float]:
        names = [f"{self.name}/{tag}/{k.hex()}" for k in keys]
        self.a.call(op="put", keys=names, sizes=sizes, api=self.api, prefer=self.prefer)
        r = self.b.call(op="lookup_get", keys=names, sizes=sizes, api=self.api)
        self.a.call(op="remove", keys=names)
        return r["lookup_s"], r["get_s"]


class RedisRaw(System):
    name = "redis-raw"

    def __init__(self, port: int, sources: list[memoryview]):
        self.a, self.b = redis_client(port), redis_client(port)
        self.sources = sources

    def run(self, tag: str, size: int, n: int, verify: bool) -> Sample:
        keys = [f"{self.name}/{tag}/{i}".encode() for i in range(n)]
        payloads = [s[:size] for s in self.sources]
        t0 = time.perf_counter()
        for i in range(0, n, BATCH):
            if not self.a.mset(dict(zip(keys[i : i + BATCH], payloads))):
                raise AssertionError("MSET failed")
        put_s = time.perf_counter() - t0
        get_s = 0.0
        for i in range(0, n, BATCH):
            t0 = time.perf_counter()
            values = self.b.mget(keys[i : i + BATCH])
            get_s += time.perf_counter() - t0
            _check_values(self.name, values, payloads, verify)
        self.a.delete(*keys)
        return Sample(put_s, get_s)

    def prompt(self, tag: str, sizes: list[int], keys: list[bytes], namespace: str) -> tuple[float, float]:
        names = [f"{self.name}/{tag}/{k.hex()}".encode() for k in keys]
        self.a.mset({k: self.sources[i % BATCH][:s] for i, (k, s) in enumerate(zip(names, sizes))})
        t0 = time.perf_counter()
        found = self.b.exists(*names)
        t1 = time.perf_counter()
        values = self.b.mget(names)
        t2 = time.perf_counter()
        if found != len(names) or [len(v) if v is not None else None for v in values] != sizes:
            raise AssertionError(f"redis prompt: {found} of {len(names)} exist")
        self.a.delete(*names)
        return t1 - t0, t2 - t1

    def close(self) -> None:
        self.a.close()
        self.b.close()


class Ours(System):
    """Node A's and node B's daemons on one remote tier.  ``probe``: a Mooncake client
    on their master (no segment) that asks where the values are."""

    def __init__(
        self, name: str, a: Node, b: Node, sources: list[memoryview], probe: MooncakeClientProcess | None = None
    ):
        self.name, self.a, self.b, self.sources, self.probe = name, a, b, sources, probe
        self._counter = 0

    def fresh_keys(self, n: int) -> list[bytes]:
        self._counter += n
        return [(self._counter - n + i).to_bytes(32, "big") for i in range(n)]

    def run(self, tag: str, size: int, n: int, verify: bool) -> Sample:
        from lmcache_client import PutStatus

        keys = self.fresh_keys(n)
        payloads = [s[:size] for s in self.sources]
        a, b = self.a.client, self.b.client
        stores = self.a.tier_stats()["stores"]
        hits = self.b.tier_stats()["hits"]
        t0 = time.perf_counter()
        for i in range(0, n, BATCH):
            statuses = a.put(keys[i : i + BATCH], payloads)
            if any(s != PutStatus.STORED for s in statuses):
                raise AssertionError(f"{self.name}: put not stored: {statuses}")
        ack_s = time.perf_counter() - t0
        self.a.wait_flushed(stores, n)
        put_s = time.perf_counter() - t0
        local_share = None
        if self.probe is not None:  # the daemon's key names (the tier's default remote_key_prefix)
            tag = hashlib.sha256(NAMESPACE.encode()).hexdigest()[:16]
            where = self.probe.call(op="where", keys=[f"lmcache:{tag}:{k.hex()}" for k in keys],
                                    holder=self.b.settings["mooncake_local_hostname"])  # fmt: skip
            local_share = where["local"] / where["n"]
        get_s = 0.0
        for i in range(0, n, BATCH):
            t0 = time.perf_counter()
            values = b.get(keys[i : i + BATCH])
            get_s += time.perf_counter() - t0
            _check_values(self.name, values, payloads, verify)
        got = self.b.tier_stats()["hits"] - hits
        if got != n:
            raise AssertionError(f"{self.name}: node B read {got} of {n} chunks from its {self.b.tier} tier")
        self._remove(keys)
        return Sample(put_s, get_s, put_ack_s=ack_s, local_share=local_share)

    def prompt(self, tag: str, sizes: list[int], keys: list[bytes], namespace: str) -> tuple[float, float]:
        from lmcache_client import PutStatus

        stores = self.a.tier_stats()["stores"]
        statuses = self.a.client.put(keys, [self.sources[i % BATCH][:s] for i, s in enumerate(sizes)],
                                     namespace=namespace)  # fmt: skip
        if any(s != PutStatus.STORED for s in statuses):
            raise AssertionError(f"{self.name}: prompt put not stored: {statuses}")
        self.a.wait_flushed(stores, len(keys))
        b = self.b.client
        t0 = time.perf_counter()
        found = b.lookup(keys, namespace=namespace)
        t1 = time.perf_counter()
        values = b.get(keys, namespace=namespace)
        t2 = time.perf_counter()
        if found.hit_chunks != len(keys):
            raise AssertionError(f"{self.name}: node B's lookup found {found.hit_chunks} of {len(keys)}: {found}")
        if [None if v is None else memoryview(v).nbytes for v in values] != sizes:
            raise AssertionError(f"{self.name}: node B's get missed")
        self._remove(keys, namespace)
        return t1 - t0, t2 - t1

    def _remove(self, keys: list[bytes], namespace: str | None = None) -> None:
        self.a.client.delete(keys, namespace=namespace)
        self.b.client.delete(keys, namespace=namespace)
        self.a.wait_idle()
        self.b.wait_idle()

    def close(self) -> None:
        self.a.close()
        self.b.close()


def _check_values(name: str, values: Sequence[Any], payloads: Sequence[memoryview], verify: bool) -> None:
    sizes = [None if v is None else memoryview(v).nbytes for v in values]
    if sizes != [p.nbytes for p in payloads[: len(values)]]:
        raise AssertionError(f"{name}: get returned sizes {sizes}")
    if verify and any(bytes(v) != bytes(p) for v, p in zip(values, payloads)):
        raise AssertionError(f"{name}: get returned wrong bytes")


# -- the run ---------------------------------------------------------------------------
class Bench:
    def __init__(self, opts: Options, procs: Processes, workdir: Path):
        self.opts, self.procs, self.workdir = opts, procs, workdir
        self.systems: dict[str, System] = {}
        self.notes: list[str] = []
        self.samples: dict[tuple[str, int], list[Sample]] = {}
        self.prompt_samples: dict[str, list[tuple[float, float]]] = {}
        self.prompt_layout: dict[str, Any] = {}
        self.cpu: CpuMeter | None = None
        # Like every process here that receives large values (the daemons run with
        # malloc_tuning: true, the Mooncake workers call it too): glibc keeps freed
        # blocks instead of unmapping them and faulting them in again on the next reply.
        self.tuned = tune_malloc()
        max_chunk = max(opts.max_chunk, self._prompt_chunk_bytes())
        self.slot = max_chunk
        self.sources = [memoryview(filled_buffer(max_chunk, i)) for i in range(BATCH)]

    def _prompt_chunk_bytes(self) -> int:
        _, layers, heads, dim = KV_MODELS[self.opts.kv_model]
        return CHUNK_TOKENS * 2 * layers * heads * dim * 2

    def start(self) -> None:
        o = self.opts
        want = set(o.systems)
        batch_bytes = BATCH * self.slot
        segment = o.rep_bytes + 2 * batch_bytes  # one repetition's values, all in one segment at worst
        buffer = 2 * batch_bytes
        pool = o.rep_bytes + 2 * batch_bytes
        redis_port = free_port()
        if want & {"redis-raw", "ours-redis"}:
            redis_dir = self.workdir / "redis"
            redis_dir.mkdir()
            redis = self.procs.start("redis", [
                o.redis_server, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(redis_dir), "--protected-mode", "no",
                "--maxmemory", str(4 * o.rep_bytes + 4 * batch_bytes), "--maxmemory-policy", "allkeys-lru",
            ])  # fmt: skip
            wait_until(lambda: _listening(redis_port), 30, "redis-server", redis.check_alive)
            version = redis_client(redis_port).info("server").get("redis_version", "?")
            self.notes.append(f"redis-server {version}, no persistence; redis-py with hiredis parser + "
                              "PythonRespSerializer")  # fmt: skip
        mc_settings = {"segment": segment, "buffer": buffer}
        if want & {"mc-raw", "mc-raw-zc"}:
            master = start_master(self.procs, o, "mooncake-master-raw", self.workdir)
            a = MooncakeClientProcess(self.procs, "mooncake-raw-A", o.mooncake_python)
            b = MooncakeClientProcess(self.procs, "mooncake-raw-B", o.mooncake_python)
            tuned = [w.call(op="setup", hostname=w.hostname, metadata=master.metadata, master=master.rpc,
                            slot=self.slot, **mc_settings)["tuned"] for w in (a, b)]  # fmt: skip
            for system in (MooncakeRaw(a, b, "bytes"), MooncakeRaw(a, b, "zc"), MooncakeRaw(a, b, "zc", far=True)):
                if system.name in want:
                    self.systems[system.name] = system
            self.notes.append(f"raw Mooncake: 2 client processes, segments of {segment >> 20} MiB, local buffers "
                              f"of {buffer >> 20} MiB, protocol tcp, one master; glibc malloc tuning (tune_malloc) "
                              f"applied in them: {tuned}, in the bench process: {self.tuned}")  # fmt: skip
        if "redis-raw" in want:
            self.systems["redis-raw"] = RedisRaw(redis_port, self.sources)
        daemon_common = {
            "max_local_cpu_size": f"{pool}B",
            "max_remote_queue_size": f"{2 * o.rep_bytes}B",
            "max_message_size": f"{max(512 * MIB, batch_bytes + MIB)}B",
            "max_inflight_bytes": f"{max(1024 * MIB, 2 * batch_bytes + 2 * MIB)}B",
        }
        if "ours-mc" in want:
            master = start_master(self.procs, o, "mooncake-master-ours", self.workdir)
            nodes = []
            for node in ("A", "B"):
                nodes.append(Node(self.procs, self.workdir, f"ours-mc-{node}", "mooncake", {
                    **daemon_common,
                    "remote_url": f"mooncake://{master.rpc}",
                    "mooncake_metadata_server": master.metadata,
                    "mooncake_local_hostname": f"127.0.0.1:{free_port()}",
                    "mooncake_segment_size": f"{segment}B",
                    "mooncake_buffer_size": f"{buffer}B",
                    "mooncake_protocol": "tcp",
                }))  # fmt: skip
            probe = MooncakeClientProcess(self.procs, "mooncake-probe", o.mooncake_python)
            probe.call(op="setup", hostname=probe.hostname, metadata=master.metadata, master=master.rpc,
                       slot=MIB, segment=0, buffer=16 * MIB)  # fmt: skip
            self.systems["ours-mc"] = Ours("ours-mc", nodes[0], nodes[1], self.sources, probe)
        if "ours-redis" in want:
            nodes = [Node(self.procs, self.workdir, f"ours-redis-{node}", "redis",
                          {**daemon_common, "remote_url": f"redis://127.0.0.1:{redis_port}"})
                     for node in ("A", "B")]  # fmt: skip
            self.systems["ours-redis"] = Ours("ours-redis", nodes[0], nodes[1], self.sources)
        if any(s.startswith("ours") for s in self.systems):
            self.notes.append(f"daemons run this checkout's code: {_checkout()}")
            self.notes.append(f"daemons: pool {pool >> 20} MiB each, max_remote_queue_size "
                              f"{2 * o.rep_bytes >> 20} MiB, on Mooncake a segment of {segment >> 20} MiB and a "
                              f"buffer of {buffer >> 20} MiB each (protocol tcp); the bench's clients on the ipc "
                              "endpoint, shared memory (same host)")  # fmt: skip
        self.systems = {name: self.systems[name] for name in SYSTEMS if name in self.systems}
        self.cpu = CpuMeter(lambda: [c.proc.pid for c in self.procs.children if c.proc.poll() is None])

    def run(self) -> None:
        o = self.opts
        if o.throughput:
            for size_mib in o.sizes_mib:
                size = size_mib * MIB
                n = _chunks_per_rep(o, size)
                t0 = time.perf_counter()
                if o.warmup:  # untimed, and every byte checked once
                    for system in self.systems.values():
                        system.run(f"warm{size_mib}", size, BATCH, verify=True)
                for rep in range(o.reps):
                    for name, system in self.systems.items():
                        sample = system.run(f"{size_mib}/{rep}", size, n, False)
                        self.samples.setdefault((name, size), []).append(sample)
                print(f"  {size_mib} MiB: {o.reps} x {n} chunks per system in {time.perf_counter() - t0:.0f}s",
                      flush=True)  # fmt: skip
        if o.prompt:
            self.run_prompt()

    def run_prompt(self) -> None:
        from lmcache_client import Namespace
        from lmcache_client.keys import prompt_keys

        o = self.opts
        model, layers, heads, dim = KV_MODELS[o.kv_model]
        ns = Namespace(model, "bfloat16", layers, heads, dim, CHUNK_TOKENS)
        per_token = ns.kv_bytes_per_token
        rng = random.Random(1000)
        t0 = time.perf_counter()
        for rep in range(o.prompt_reps + (1 if o.warmup else 0)):
            tokens = [rng.randrange(1, 128000) for _ in range(o.prompt_tokens)]
            keys, tail = prompt_keys(tokens, CHUNK_TOKENS)
            sizes = [CHUNK_TOKENS * per_token] * len(keys)
            if tail is not None:
                keys.append(tail)
                sizes.append((o.prompt_tokens - CHUNK_TOKENS * (len(keys) - 1)) * per_token)
            if not self.prompt_layout:
                self.prompt_layout = {"model": model, "namespace": ns.wire(), "kv_bytes_per_token": per_token,
                                      "chunk_tokens": CHUNK_TOKENS, "prompt_tokens": o.prompt_tokens,
                                      "chunk_bytes": sizes}  # fmt: skip
            for name, system in self.systems.items():
                timing = system.prompt(f"prompt{rep}", sizes, keys, ns.wire())
                if rep > 0 or not o.warmup:
                    self.prompt_samples.setdefault(name, []).append(timing)
        print(f"  prompt: {o.prompt_reps} repetitions per system in {time.perf_counter() - t0:.0f}s", flush=True)

    def close(self) -> None:
        for system in self.systems.values():
            system.close()

    # -- report --------------------------------------------------------------------------
    def rate(self, name: str, op: str, size: int) -> float | None:
        samples = self.samples.get((name, size))
        if not samples:
            return None
        n_bytes = _chunks_per_rep(self.opts, size) * size / MIB
        if op == "put":
            return statistics.median(n_bytes / s.put_s for s in samples)
        if op == "ack":
            acks = [s.put_ack_s for s in samples if s.put_ack_s]
            return statistics.median(n_bytes / s for s in acks) if acks else None
        return statistics.median(n_bytes / s.get_s for s in samples)

    def report(self) -> dict[str, Any]:
        o = self.opts
        result: dict[str, Any] = {"options": {**dataclasses.asdict(o), "out": str(o.out) if o.out else None}}
        if self.cpu is not None:
            outside = self.cpu.outside_load()
            warn = "  WARNING: the figures are noisy; rerun on a quiet machine" if outside > 0.1 else ""
            self.notes.append(f"CPU used by other processes while measuring: {outside:.2f} cores{warn}")
            result["outside_load_cores"] = round(outside, 3)
        print()
        for note in self.notes:
            print(f"note: {note}")
        result["notes"] = self.notes
        if self.samples:
            result["throughput"], result["ratios"] = self._throughput_table()
        if self.prompt_samples:
            result["prompt"] = self._prompt_table()
        return result

    def _throughput_table(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        o = self.opts
        names = list(self.systems)
        ratio_defs = [("ours-mc", "mc-raw-zc"), ("ours-mc", "mc-raw"), ("mc-raw-zc", "redis-raw"),
                      ("mc-zc-far", "redis-raw"), ("ours-mc", "ours-redis"), ("ours-redis", "redis-raw")]  # fmt: skip
        ratio_defs = [(x, y) for x, y in ratio_defs if x in names and y in names]
        print(f"\n(a) throughput, MiB/s, median of {o.reps} repetitions of about {o.rep_mib} MiB; {BATCH} chunks a "
              "request; put = until the bytes are in the remote tier (ours: write-behind flushed), "
              "get = node B reads them (ours: from the remote tier)")  # fmt: skip
        head = f"{'op':3s} {'size':>6s} " + " ".join(f"{n:>10s}" for n in names)
        print(head)
        print("-" * len(head))
        rows: list[dict[str, Any]] = []
        ratios: list[dict[str, Any]] = []
        for op in OPS:
            for size_mib in o.sizes_mib:
                size = size_mib * MIB
                print(f"{op:3s} {size_mib:3d} MiB " + " ".join(f"{_fmt(self.rate(n, op, size)):>10s}" for n in names))
                n_mib = _chunks_per_rep(o, size) * size / MIB
                for n in names:
                    samples = self.samples[(n, size)]
                    times = [s.put_s if op == "put" else s.get_s for s in samples]
                    rows.append({"system": n, "op": op, "size_bytes": size, "mib_per_s": _round(self.rate(n, op, size)),
                                 "rep_mib_per_s": [round(n_mib / t, 1) for t in times],
                                 "chunks_per_rep": _chunks_per_rep(o, size), "reps": len(samples)})  # fmt: skip
                    if op == "put" and samples[0].put_ack_s is not None:
                        rows[-1]["acked_mib_per_s"] = _round(self.rate(n, "ack", size))
                    if op == "get" and samples[0].local_share is not None:
                        rows[-1]["b_local_share"] = round(statistics.mean(s.local_share or 0 for s in samples), 3)
                for x, y in ratio_defs:
                    rx, ry = self.rate(x, op, size), self.rate(y, op, size)
                    ratios.append({"op": op, "size_bytes": size, "of": x, "to": y,
                                   "ratio": round(rx / ry, 3) if rx and ry else None})  # fmt: skip
        if ratio_defs:
            print("\nratios of those medians (same run)")
            head = f"{'op':3s} {'size':>6s} " + " ".join(f"{x + '/' + y:>20s}" for x, y in ratio_defs)
            print(head)
            print("-" * len(head))
            for op in OPS:
                for size_mib in o.sizes_mib:
                    size = size_mib * MIB
                    cells = [_ratio(self.rate(x, op, size), self.rate(y, op, size)) for x, y in ratio_defs]
                    print(f"{op:3s} {size_mib:3d} MiB " + " ".join(f"{c:>20s}" for c in cells))
        ours = [n for n in names if n.startswith("ours")]
        if ours:
            print("put (acked): MiB/s until the daemon answered STORED, before its write-behind: " + "; ".join(
                f"{n} " + ", ".join(f"{s} MiB {_fmt(self.rate(n, 'ack', s * MIB))}" for s in o.sizes_mib)
                for n in ours))  # fmt: skip
        for group in (("mc-raw", "mc-raw-zc"), ("mc-zc-far",), ("ours-mc",)):
            share = [s.local_share for n in group if n in names for size in o.sizes_mib
                     for s in self.samples[(n, size * MIB)] if s.local_share is not None]  # fmt: skip
            if share:
                print(f"{' and '.join(n for n in group if n in names)}: {statistics.mean(share):.0%} of the values "
                      "node B got were in its own segment (a local copy for B; the rest crossed TCP from node A's "
                      "segment)")  # fmt: skip
        return rows, ratios

    def _prompt_table(self) -> dict[str, Any]:
        o = self.opts
        lay = self.prompt_layout
        print(f"\n(b) cross-node hit, {o.prompt_tokens}-token prompt, {lay['model']} KV layout "
              f"({lay['kv_bytes_per_token'] >> 10} KiB a token, {CHUNK_TOKENS}-token chunks: "
              f"{', '.join(f'{b / MIB:.2f}' for b in lay['chunk_bytes'])} MiB); node B, ms, "
              f"median [p90] of {o.prompt_reps} repetitions, each a fresh prompt")  # fmt: skip
        print(f"{'system':>10s} {'lookup':>16s} {'get':>16s} {'lookup+get':>16s}")
        out: dict[str, Any] = {"layout": lay, "systems": {}}
        for name, samples in self.prompt_samples.items():
            cols = {"lookup": [s[0] * 1e3 for s in samples], "get": [s[1] * 1e3 for s in samples],
                    "lookup+get": [(s[0] + s[1]) * 1e3 for s in samples]}  # fmt: skip
            print(f"{name:>10s} " + " ".join(
                f"{statistics.median(v):>7.2f} [{percentile(v, 90):>6.2f}]" for v in cols.values()))  # fmt: skip
            out["systems"][name] = {k: {"median_ms": round(statistics.median(v), 3),
                                        "p90_ms": round(percentile(v, 90), 3),
                                        "samples_ms": [round(x, 3) for x in v]}
                                    for k, v in cols.items()}  # fmt: skip
        pairs = [("ours-mc", "ours-redis"), ("mc-raw-zc", "redis-raw"), ("mc-zc-far", "redis-raw"),
                 ("ours-mc", "mc-raw-zc"), ("ours-redis", "redis-raw")]  # fmt: skip
        out["ratios"] = {}
        for x, y in pairs:
            if x in out["systems"] and y in out["systems"]:
                r = out["systems"][x]["lookup+get"]["median_ms"] / out["systems"][y]["lookup+get"]["median_ms"]
                out["ratios"][f"{x}/{y}"] = round(r, 3)
                print(f"  lookup+get time {x}/{y}: {r:.2f}x" + ("  (< 1: the first is faster)" if x == "ours-mc"
                                                                 and y == "ours-redis" else ""))  # fmt: skip
        return out


def _checkout() -> str:
    """The commit of the checkout the daemons run (``-dirty`` with uncommitted changes)."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10)  # fmt: skip
        return out.stdout.strip() or "unknown (not a git checkout)"
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _ratio(num: float | None, den: float | None) -> str:
    return "-" if not num or not den else f"{num / den:.2f}x"


def _default_master() -> str:
    beside = Path(sys.executable).parent / "mooncake_master"
    return str(beside) if beside.exists() else (shutil.which("mooncake_master") or "mooncake_master")


def _parse_args(argv: Sequence[str] | None) -> Options:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="short run: 2 reps of ~64 MiB, 5 prompt reps")
    p.add_argument("--sizes", default="1,4,16,32", help="chunk sizes in MiB (default 1,4,16,32)")
    p.add_argument("--reps", type=int, help="timed repetitions per cell (default 9; quick: 2)")
    p.add_argument("--rep-mib", type=int, help="MiB of fresh chunks per repetition (default 512; quick: 64)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed, byte-checked first round")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}")
    p.add_argument("--no-throughput", action="store_true", help="skip part (a)")
    p.add_argument("--no-prompt", action="store_true", help="skip part (b)")
    p.add_argument("--prompt-tokens", type=int, default=1000, help="tokens of the prompt in part (b) (default 1000)")
    p.add_argument("--prompt-reps", type=int, help="repetitions of part (b) (default 20; quick: 5)")
    p.add_argument("--kv-model", choices=sorted(KV_MODELS), default="llama-3.2-1b",
                   help="KV layout of part (b)'s chunks (bfloat16; default llama-3.2-1b: 32 KiB a token)")  # fmt: skip
    p.add_argument("--out", type=Path, metavar="FILE.json", help="write the figures as JSON")
    p.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    p.add_argument("--mooncake-master", default=_default_master(), help="the mooncake_master binary")
    p.add_argument("--mooncake-python", default=sys.executable,
                   help="interpreter of the raw Mooncake clients (needs mooncake; default this one)")  # fmt: skip
    a = p.parse_args(argv)
    sizes = tuple(int(s) for s in a.sizes.split(",") if s.strip())
    systems = tuple(s.strip() for s in a.systems.split(",") if s.strip())
    if not sizes or min(sizes) < 1:
        p.error("--sizes needs positive integers")
    if unknown := set(systems) - set(SYSTEMS):
        p.error(f"unknown systems {sorted(unknown)}")
    return Options(
        sizes_mib=sizes,
        reps=a.reps or (2 if a.quick else 9),
        rep_mib=a.rep_mib or (64 if a.quick else 512),
        warmup=not a.no_warmup,
        systems=systems,
        throughput=not a.no_throughput,
        prompt=not a.no_prompt,
        prompt_tokens=a.prompt_tokens,
        prompt_reps=a.prompt_reps or (5 if a.quick else 20),
        kv_model=a.kv_model,
        out=a.out,
        redis_server=a.redis_server,
        mooncake_master=a.mooncake_master,
        mooncake_python=a.mooncake_python,
    )


def main(argv: Sequence[str] | None = None) -> int:
    opts = _parse_args(argv)
    raise_on_sigterm()
    started = time.perf_counter()
    announce_load()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    with workspace("lmcache-bench-mc-", env) as (procs, workdir):
        bench: Bench | None = None
        try:
            bench = Bench(opts, procs, workdir)
            bench.start()
            print(f"started {', '.join(bench.systems)} in {time.perf_counter() - started:.0f}s", flush=True)
            bench.run()
            result = bench.report()
            if opts.out is not None:
                opts.out.write_text(json.dumps(result, indent=1) + "\n")
                print(f"wrote {opts.out}")
            print(f"\ntotal {time.perf_counter() - started:.0f}s")
            return 0
        except KeyboardInterrupt:
            print("\ninterrupted; stopping the servers", file=sys.stderr)
            return 130
        finally:
            if bench is not None:
                bench.close()


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "mooncake-worker":
        sys.exit(worker_main())
    sys.exit(main())
