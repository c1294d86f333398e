"""The tier gate (what the disk and Redis tiers take), replayed on a prefix-block trace (issue #27 item 2).

For each memory capacity (``--capacity-pct`` of the trace's distinct blocks) the
trace is replayed through a model of the three tiers, once per gate mode
(``always``, ``reused``, ``frequency``, set for both lower tiers), and the script
reports the token hit rate and the bytes written to disk and to Redis per hit
token, with each mode's ratios against ``always`` of the same capacity, measured
in the same run.

The model (one chunk size, capacities in chunks):

- memory: ``--capacity-pct`` of the distinct blocks, the daemon's ``cache_policy``
  classes (``make_policy(name, capacity)``, ``adaptive`` by default as in the
  daemon: its head rule answers some puts SKIPPED, and a chunk memory skipped
  is written nowhere, so ``always`` can stay below the trace's unbounded hit rate);
- disk: ``--disk-factor`` (10) times memory, ``make_policy(name)`` (``lfuda``
  for ``adaptive``, as the daemon's disk tier);
- Redis: unbounded (no TTL), every write counted.

Per request, as the engine and the daemon do it (``replay_trace.py``; the
daemon side is :class:`lmcache_server.storage.TieredStore`):

1. ``lookup``: the leading blocks held in any tier are the hit;
2. ``get`` of those: a memory hit is touched; a disk or Redis hit is promoted
   into memory (evicting as needed); then each hit is an access;
3. ``put`` of the rest, in prefix order: a block memory holds is ``EXISTS`` (an
   access); a new one is offered to the memory policy (``admit``), evicts
   victims until it fits, is stored, and Redis is asked (queued if admitted).

``--modes`` picks the rows: a mode for both lower tiers, ``DISK/REDIS`` for
one each (``always/reused``: every evicted chunk to disk, only reused ones to
Redis), and ``oracle``, an offline bound (no daemon setting):
both tiers admit exactly the chunks the trace accesses again, so it shows the
most any gate rule could save at that hit rate.

Each eviction from memory is a spill: a chunk on disk already is not written;
otherwise the disk's gate decides, and a chunk passed is written to
disk (evicting the disk policy's victims).  The gate calls are the
daemon's own, in the daemon's order (:class:`~lmcache_server.storage.tiered.StoreGate`:
``stored``, ``accessed``, ``uplinked``, ``from_remote``, ``spill`` with the
disk's next victim when the disk is full, ``evicted``, ``removed``), with the
sketch sized as the daemon sizes it for these capacities.  Not modelled: the
spill queue's bound, lent spills (the daemon keeps a declined lent chunk until
a put needs its room; the model evicts on demand only), Redis' memory policy.

Usage::

    python benchmarks/replay_admission.py [--capacity-pct 2,5,10] [--policy adaptive]
        [--modes always,reused,frequency,always/reused,oracle] [--bytes-per-block 29360128]
        [--limit N] [--json OUT]
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from policy_sim import DEFAULT_TRACE, Counts, Request, capacities_from, distinct_blocks, load_trace, trace_keys  # noqa: E402

from lmcache_server.storage.base import ChunkKey  # noqa: E402
from lmcache_server.storage.policy import EvictionPolicy, make_policy  # noqa: E402
from lmcache_server.storage.tiered.gate import (  # noqa: E402
    MODES,
    Accesses,
    StoreGate,
    TierGate,
    sketch_width_for,
)

QWEN7B_BLOCK_BYTES = 512 * 56 * 1024
"""A 512-token block of Qwen2.5-7B (bf16): 28 MiB."""


ORACLE = "oracle"
"""An offline bound, not a daemon setting: both tiers admit exactly the chunks the
trace will access again (after the current request)."""


def _never(key: ChunkKey) -> bool:
    return False


class FutureUse:
    """Which keys the trace accesses again after the request being replayed."""

    def __init__(self, requests: Sequence[Request], keys: dict[int, ChunkKey]):
        self.uses: dict[ChunkKey, list[int]] = {}
        for i, req in enumerate(requests):
            for b in req.hash_ids:
                self.uses.setdefault(keys[b], []).append(i)
        self.now = 0

    def again(self, key: ChunkKey) -> bool:
        uses = self.uses.get(key, [])
        return bisect.bisect_right(uses, self.now) < len(uses)


class OracleRule(TierGate):
    """A tier's gate that knows the future (``reused``'s bookkeeping, :class:`FutureUse`'s verdict)."""

    def __init__(self, tier: str, accesses: Accesses, future: FutureUse):
        super().__init__(tier, "reused", accesses)
        self.future = future

    def passes(self, key: ChunkKey, victim: Callable[[], ChunkKey | None] | None = None) -> bool:
        return self.future.again(key)


@dataclasses.dataclass
class Written:
    disk_chunks: int = 0
    redis_chunks: int = 0
    dropped_spills: int = 0


class TierModel:
    """Memory, disk and Redis of one daemon (see the module), with the tier gate."""

    def __init__(self, memory_cap: int, disk_cap: int, policy: str, mode: str, block_bytes: int):
        self.memory_cap, self.disk_cap = memory_cap, disk_cap
        self.block_bytes = block_bytes
        self.mpolicy: EvictionPolicy = make_policy(policy, memory_cap)
        self.dpolicy: EvictionPolicy = make_policy(policy)
        self.memory: set[ChunkKey] = set()
        self.disk: set[ChunkKey] = set()
        self.redis: set[ChunkKey] = set()
        disk_mode, _, remote_mode = ("reused" if mode == ORACLE else mode).partition("/")
        self.gate = StoreGate(
            disk_mode, remote_mode or disk_mode, sketch_width=sketch_width_for((memory_cap + disk_cap) * block_bytes)
        )
        self.future: FutureUse | None = None
        if mode == ORACLE:
            self.future = FutureUse(_TRACE, _KEYS)
            self.gate.disk = OracleRule("disk", self.gate.accesses, self.future)
            self.gate.remote = OracleRule("redis", self.gate.accesses, self.future)
        self.written = Written()

    # -- the tiers -------------------------------------------------------------------
    def held(self, key: ChunkKey) -> bool:
        return key in self.memory or key in self.disk or key in self.redis

    def _disk_victim(self) -> ChunkKey | None:
        return self.dpolicy.victim(_never) if len(self.disk) >= self.disk_cap else None

    def _spill(self, key: ChunkKey) -> None:
        """The store's Spill.evicted for an eviction a put waits for (final)."""
        gate = self.gate
        if key in self.disk:
            gate.evicted(key)
            return
        if not gate.spill(key, self.block_bytes, self._disk_victim, final=True):
            gate.evicted(key)
            return
        gate.evicted(key)
        while len(self.disk) >= self.disk_cap:
            victim = self.dpolicy.victim(_never)
            assert victim is not None
            self.disk.remove(victim)
            self.dpolicy.removed(victim)
        self.disk.add(key)
        self.dpolicy.inserted(key, 1, None)
        self.written.disk_chunks += 1

    def _room(self) -> bool:
        """Evict memory's victims until one chunk fits (False: nothing evictable)."""
        while len(self.memory) >= self.memory_cap:
            victim = self.mpolicy.victim(_never)
            if victim is None:
                return False
            self._spill(victim)
            self.memory.remove(victim)
            self.mpolicy.removed(victim)
            self.gate.removed(victim)
        return True

    def _insert(self, key: ChunkKey, parent: ChunkKey | None) -> bool:
        if not self._room():
            return False
        self.memory.add(key)
        self.mpolicy.inserted(key, 1, parent)
        return True

    def _uplink(self, key: ChunkKey) -> None:
        self.redis.add(key)
        self.written.redis_chunks += 1
        self.gate.uplinked(key, self.block_bytes)

    def _accessed(self, key: ChunkKey) -> None:
        resident = key in self.memory
        if self.gate.accessed(key, resident) and resident:
            self._uplink(key)

    # -- one request -----------------------------------------------------------------
    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        n = 0
        for key in keys:
            if not self.held(key):
                break
            n += 1
        return n

    def get(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            if key in self.memory:
                self.mpolicy.touched(key)
            elif key in self.disk:
                self.dpolicy.touched(key)
                self._insert(key, None)  # promoted (no Redis write: not a put)
            elif self._insert(key, None):  # a Redis hit, promoted
                self.gate.from_remote(key)
        for key in keys:
            self._accessed(key)

    def put(self, keys: Sequence[ChunkKey]) -> None:
        parent: ChunkKey | None = None
        for key in keys:
            if key in self.memory:
                self.mpolicy.touched(key)
                self._accessed(key)  # EXISTS
            elif (
                self.mpolicy.admit(key, 1, parent)
                and self._insert(key, parent)
                and self.gate.stored(key, self.block_bytes)
            ):
                self._uplink(key)  # stored, and Redis admits it now
            parent = key


def replay(requests: Sequence[Request], keys: dict[int, ChunkKey], model: TierModel) -> Counts:
    counts = Counts()
    for i, req in enumerate(requests):
        if model.future is not None:
            model.future.now = i
        ks = [keys[b] for b in req.hash_ids]
        hits = model.lookup(ks)
        model.get(ks[:hits])
        model.put(ks[hits:])
        counts.add_request(req, hits)
    return counts


_TRACE: list[Request] = []
_KEYS: dict[int, ChunkKey] = {}


DEFAULT_MODES = (*MODES, "always/reused", ORACLE)
"""What is replayed: a mode for both lower tiers, ``DISK/REDIS`` for one each, or the oracle."""


def _cell(cell: tuple[int, str, str, int, int]) -> dict[str, Any]:
    memory_cap, mode, policy, disk_factor, block_bytes = cell
    started = time.perf_counter()
    model = TierModel(memory_cap, disk_factor * memory_cap, policy, mode, block_bytes)
    counts = replay(_TRACE, _KEYS, model)
    w = model.written
    stats = model.gate.stats()
    return {
        "memory_blocks": memory_cap,
        "disk_blocks": disk_factor * memory_cap,
        "mode": mode,
        "policy": policy,
        "token_hit_rate": counts.token_hit_rate,
        "hit_tokens": counts.hit_tokens,
        "total_tokens": counts.total_tokens,
        "disk_bytes_written": w.disk_chunks * block_bytes,
        "redis_bytes_written": w.redis_chunks * block_bytes,
        "disk_declined": stats["disk"]["declined"],
        "redis_declined": stats["redis"]["declined"],
        "seconds": time.perf_counter() - started,
    }


def run(
    requests: list[Request], caps: Sequence[int], policy: str, disk_factor: int, block_bytes: int,
    processes: int, progress: Callable[[str], None] = print, modes: Sequence[str] = DEFAULT_MODES,
) -> list[dict[str, Any]]:  # fmt: skip
    global _TRACE, _KEYS
    _TRACE, _KEYS = requests, trace_keys(requests)
    if "always" not in modes:
        modes = ["always", *modes]  # the baseline of the ratios
    for mode in modes:
        if mode != ORACLE and not all(m in MODES for m in mode.split("/")):
            raise ValueError(f"unknown mode {mode!r}: one of {', '.join(MODES)}, DISK/REDIS of them, or {ORACLE}")
    cells = [(c, m, policy, disk_factor, block_bytes) for c in caps for m in modes]
    rows: list[dict[str, Any]] = []
    if processes > 1:
        with multiprocessing.get_context("fork").Pool(min(processes, len(cells))) as pool:
            for row in pool.imap_unordered(_cell, cells):
                progress(f"{row['memory_blocks']:>7} blocks {row['mode']:>13}: {row['token_hit_rate']:.4f} "
                         f"({row['seconds']:.0f}s)")  # fmt: skip
                rows.append(row)
    else:
        for cell in cells:
            rows.append(_cell(cell))
            progress(f"{cell[0]:>7} blocks {cell[1]:>13}: {rows[-1]['token_hit_rate']:.4f}")
    order = {(c, m): i for i, (c, m, *_) in enumerate(cells)}
    rows.sort(key=lambda r: order[(r["memory_blocks"], r["mode"])])
    for row in rows:
        hit = max(row["hit_tokens"], 1)
        row["disk_bytes_per_hit_token"] = row["disk_bytes_written"] / hit
        row["redis_bytes_per_hit_token"] = row["redis_bytes_written"] / hit
        row["written_bytes_per_hit_token"] = (row["disk_bytes_written"] + row["redis_bytes_written"]) / hit
        base = next(r for r in rows if r["memory_blocks"] == row["memory_blocks"] and r["mode"] == "always")
        row["hit_rate_delta_vs_always"] = row["token_hit_rate"] - base["token_hit_rate"]
        row["written_per_hit_token_reduction_vs_always"] = (
            base["written_bytes_per_hit_token"] / row["written_bytes_per_hit_token"]
            if row["written_bytes_per_hit_token"]
            else float("inf")
        )
    return rows


def print_table(rows: Sequence[dict[str, Any]], distinct: int) -> None:
    print(f"{'memory':>15} {'mode':>13} {'hit rate':>8} {'vs always':>9} {'disk KiB/hit tok':>16} "
          f"{'Redis KiB/hit tok':>17} {'both':>8} {'reduction':>9}")  # fmt: skip
    for r in rows:
        print(
            f"{r['memory_blocks']:>7} ({100 * r['memory_blocks'] / distinct:4.1f}%) {r['mode']:>13} "
            f"{r['token_hit_rate']:8.4f} {r['hit_rate_delta_vs_always']:+9.4f} "
            f"{r['disk_bytes_per_hit_token'] / 1024:16.1f} {r['redis_bytes_per_hit_token'] / 1024:17.1f} "
            f"{r['written_bytes_per_hit_token'] / 1024:8.1f} {r['written_per_hit_token_reduction_vs_always']:8.2f}x"
        )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--capacity-pct", default="2,5,10", help="memory capacities, percent of the distinct blocks")
    ap.add_argument("--disk-factor", type=int, default=10, help="disk capacity / memory capacity")
    ap.add_argument("--policy", default="adaptive", help="cache_policy of memory (and disk, as the daemon)")
    ap.add_argument("--bytes-per-block", type=int, default=QWEN7B_BLOCK_BYTES)
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--processes", type=int, default=min(os.cpu_count() or 1, 9))
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help="modes, DISK/REDIS pairs, oracle")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    requests = load_trace(args.trace, args.limit)
    distinct = distinct_blocks(requests)
    caps = capacities_from([float(x) for x in args.capacity_pct.split(",")], distinct)
    print(f"{len(requests)} requests, {distinct} distinct blocks; memory {caps} blocks, disk x{args.disk_factor}, "
          f"Redis unbounded; cache_policy {args.policy}; {args.bytes_per_block / 2**20:.0f} MiB a block",
          flush=True)  # fmt: skip
    started = time.perf_counter()
    rows = run(requests, caps, args.policy, args.disk_factor, args.bytes_per_block, args.processes,
               lambda s: print(s, flush=True), args.modes.split(","))  # fmt: skip
    print(f"replayed {len(rows)} runs in {time.perf_counter() - started:.0f}s")
    print_table(rows, distinct)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
