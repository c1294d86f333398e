"""Crash consistency of the disk tier: SIGKILL the daemon in the middle of a put storm.

Each round runs a put storm (two client threads, chunks of random sizes
50 KiB..1 MiB, an 8 MiB memory tier spilling to a 64 MiB disk tier), SIGKILLs
the daemon at a random delay into the storm, restarts it on the same spill
directory and reads back every key any client ever sent.  A read may miss (the
chunk was in memory, in flight, torn or evicted), but a hit must have exactly
the bytes that were put: the payload of a key is a pure function of the key, so
the client's record is exact, not a checksum.  The RNG is seeded; every round
asserts the daemon came back (ping), and the disk tier must have rebuilt
entries from the files of the previous life in at least some rounds.

The warm-restart variant (storage/memory/warmstart.py) has no disk tier and puts
over shared memory: its rounds alternate a clean stop (SIGTERM: the next
daemon adopts the pool, writers may still be copying into their slots) and a
SIGKILL (the next start must be cold: not one hit), with the same rule that a
hit has exactly the bytes put.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

from lmcache_client import DaemonUnavailable, ServerError

from ...conftest import Daemon

KiB = 1024
MiB = 1024 * KiB
ROUNDS = int(os.environ.get("LMCACHE_CRASH_ROUNDS", "8"))
"""8 in the suite; longer campaigns (docs/security.md) set LMCACHE_CRASH_ROUNDS."""
WARM_ROUNDS = int(os.environ.get("LMCACHE_WARM_CRASH_ROUNDS", "8"))
"""Rounds of the warm-restart variant: 8 in the suite, 50 for docs/operations.md."""
SEED = 20240707


def payload_for(key: bytes, size: int) -> bytes:
    """The bytes stored under ``key``: reproducible from the key and size alone."""
    return random.Random(key).randbytes(size)


class Storm:
    """Client threads putting fresh keys until stopped; every key is recorded before it is sent."""

    def __init__(self, daemon: Daemon, round_no: int, rng: random.Random, record: dict[bytes, int]):
        self.daemon = daemon
        self.round_no = round_no
        self.record = record
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.sizes = [rng.randint(50 * KiB, 1 * MiB) for _ in range(4096)]
        self.seeds = [rng.getrandbits(32) for _ in range(2)]
        self.stored = 0
        self.threads = [threading.Thread(target=self.run, args=(t,), daemon=True) for t in range(2)]

    def run(self, thread_no: int) -> None:
        rng = random.Random(self.seeds[thread_no])
        try:
            with self.daemon.client(timeout_s=1.0) as c:
                i = 0
                while not self.stop.is_set():
                    batch = rng.randint(1, 3)
                    keys, payloads = [], []
                    for _ in range(batch):
                        key = hashlib.sha256(f"r{self.round_no}-t{thread_no}-{i}".encode()).digest()
                        size = self.sizes[rng.randrange(len(self.sizes))]
                        i += 1
                        keys.append(key)
                        payloads.append(payload_for(key, size))
                        with self.lock:
                            self.record[key] = size
                    statuses = c.put(keys, payloads)
                    with self.lock:
                        self.stored += sum(1 for s in statuses if s == 0)
        except (DaemonUnavailable, ServerError):
            return  # the daemon was killed under us

    def __enter__(self) -> Storm:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(15)
            assert not t.is_alive(), "a storm thread hung"


def verify(daemon: Daemon, record: dict[bytes, int]) -> tuple[int, int]:
    """Read back every recorded key; (hits, misses).  Wrong bytes fail the test."""
    hits = misses = 0
    keys = list(record)
    with daemon.client(timeout_s=10.0) as c:
        for start in range(0, len(keys), 6):
            batch = keys[start : start + 6]
            for key, got in zip(batch, c.get(batch)):
                if got is None:
                    misses += 1
                    continue
                want = payload_for(key, record[key])
                data = bytes(got)
                assert len(data) == len(want), f"key {key.hex()}: {len(data)} bytes read, {len(want)} put"
                assert data == want, f"key {key.hex()}: bytes read differ from bytes put"
                hits += 1
    return hits, misses


def test_sigkill_during_put_storm_never_returns_wrong_bytes(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    rng = random.Random(SEED)
    daemon = daemon_factory(
        local_disk=f"file://{tmp_path / 'spill'}",
        max_local_cpu_size="8MiB",
        max_local_disk_size="64MiB",
        stats_log_interval_s=0,
    )
    record: dict[bytes, int] = {}
    rebuilt_rounds: list[int] = []
    total_hits = 0
    started = time.monotonic()
    for round_no in range(ROUNDS):
        delay = rng.uniform(0.3, 1.5)
        with Storm(daemon, round_no, rng, record) as storm:
            time.sleep(delay)
            daemon.kill()  # SIGKILL while the threads are mid-put
        assert daemon.proc is not None and daemon.proc.returncode == -9
        daemon.start()
        with daemon.client(timeout_s=5.0) as c:
            assert c.ping() >= 0
            rebuilt = c.stats()["tiers"]["disk"]["rebuilt_entries"]
        if rebuilt > 0:
            rebuilt_rounds.append(round_no)
        hits, misses = verify(daemon, record)
        total_hits += hits
        print(
            f"round {round_no}: kill after {delay:.2f}s, {storm.stored} stored this round, "
            f"{len(record)} keys recorded, rebuilt {rebuilt}, read back {hits} hits / {misses} misses"
        )
    print(f"{ROUNDS} rounds in {time.monotonic() - started:.1f}s")
    assert rebuilt_rounds, "the disk tier never rebuilt an entry after a restart"
    assert total_hits > 0, "nothing could ever be read back after a crash"
    # And the daemon is still a working cache after all the crashes.
    with daemon.client() as c:
        key = hashlib.sha256(b"after-the-storm").digest()
        c.put([key], [payload_for(key, 100 * KiB)])
        got = c.get([key])[0]
        assert got is not None and bytes(got) == payload_for(key, 100 * KiB)


def test_warm_restarts_and_sigkills_under_a_shared_memory_storm_never_return_wrong_bytes(
    daemon_factory: Callable[..., Daemon],
) -> None:
    rng = random.Random(SEED + 1)
    daemon = daemon_factory(warm_restart=True, max_local_cpu_size="16MiB", stats_log_interval_s=0, drain_timeout_s=2)
    with daemon.client() as c:
        assert c.uses_shared_memory
    since_cold: dict[bytes, int] = {}  # keys put since the last cold start: all the pool can hold
    adopted_hits = clean_stops = 0
    for round_no in range(WARM_ROUNDS):
        kill = round_no % 2 == 1
        record: dict[bytes, int] = {}
        with Storm(daemon, round_no, rng, record) as storm:
            time.sleep(rng.uniform(0.3, 1.0))
            if kill:
                daemon.kill()
            else:
                assert daemon.stop() == 0
        since_cold.update(record)
        daemon.start()
        hits, misses = verify(daemon, since_cold)
        if kill:
            assert hits == 0, "a daemon started after a SIGKILL served chunks of the previous life"
            since_cold = {}
        else:
            clean_stops += 1
            adopted_hits += hits
        print(
            f"warm round {round_no}: {'SIGKILL' if kill else 'SIGTERM'}, {storm.stored} stored, "
            f"read back {hits} hits / {misses} misses"
        )
    assert daemon.log().count("warm restart: adopted") == clean_stops
    assert adopted_hits > 0, "no clean stop ever kept a chunk"
