"""Records with token ids (format 2) under seeded random traffic, against a real daemon
with KV events, a disk tier and a real redis-server: puts with token ids, gets, deletes,
evictions (spills to disk, writes to Redis), promotions, and crashes (SIGKILL) and clean
restarts between them, in random orders.  Keys name their content (as an engine's do:
the same tokens, the same KV), so each key has one payload, drawn at random; every
get answers exactly that key's bytes or a miss (never another key's, never a deleted
chunk's), and the daemon's events build without error through every restart.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from lmcache_client.keys import chunk_keys, chunk_tokens
from lmcache_client.protocol import PutStatus

from ..conftest import Daemon, RedisServer
from .test_events import CHUNK, NS, events_daemon, quiet

MiB = 1 << 20


@pytest.mark.parametrize("seed", [11, 12])
def test_random_puts_gets_deletes_and_crashes_never_serve_wrong_bytes(
    daemon_factory: Callable[..., Daemon], redis_server: RedisServer, tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    daemon = events_daemon(
        daemon_factory,
        local_disk=f"file://{tmp_path / 'spill'}",
        max_local_cpu_size="4MiB",
        max_local_disk_size="12MiB",
        spill_ahead_size=0,
        remote_url=redis_server.url,
        warm_restart=False,
    )
    prompts = [[rng.randrange(50_000) for _ in range(3 * CHUNK)] for _ in range(6)]
    content: dict[bytes, bytes] = {}  # key -> its payload (one per key: keys name their content)
    stored: set[bytes] = set()
    deleted: set[bytes] = set()
    served = {"hits": 0, "misses": 0}
    restored = after_restart = 0
    for round_ in range(4):
        with daemon.client(namespace=NS) as c:
            for _ in range(25):
                tokens = rng.choice(prompts)[: rng.randrange(1, 4) * CHUNK]
                keys, toks = chunk_keys(tokens, CHUNK), chunk_tokens(tokens, CHUNK)
                op = rng.random()
                if op < 0.45:
                    payloads = [content.setdefault(k, os.urandom(MiB)) for k in keys]
                    for key, status in zip(keys, c.put(keys, payloads, tokens=toks)):
                        if status is PutStatus.NO_SPACE:  # the pool's room still held by spills: not stored
                            continue
                        assert status in (PutStatus.STORED, PutStatus.EXISTS), status
                        stored.add(key)
                        deleted.discard(key)
                elif op < 0.9:
                    for key, got in zip(keys, c.get(keys)):
                        if got is None:
                            served["misses"] += 1
                            continue
                        assert key not in deleted and key in stored, "a deleted (or never put) chunk was served"
                        assert bytes(got) == content[key], "wrong bytes served"
                        served["hits"] += 1
                else:
                    key = rng.choice(keys)
                    c.delete([key])
                    stored.discard(key)
                    deleted.add(key)
            quiet(c)
            assert c.stats()["events"]["errors"] == 0
        if round_ % 2 == 0:
            daemon.kill()  # a crash: the next start scans the disk and reads Redis records
        else:
            assert daemon.stop() == 0
        daemon.start()
        with daemon.client(namespace=NS) as c:
            restored += int(quiet(c)["restored_chunks"])
            keys = sorted(stored)
            for key, got in zip(keys, c.get(keys)):  # memory is empty: the disk's and Redis' records
                if got is not None:
                    assert bytes(got) == content[key], "wrong bytes served after a restart"
                    after_restart += 1
    assert served["hits"] > 0 and after_restart > 0
    assert restored > 0  # chunks announced again at start: the kept file, or the records' token ids
