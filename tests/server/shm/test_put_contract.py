"""The put contract (issue 29 items 12 and 13): first writer wins, the later
put of a key is EXISTS, whichever path (payload frames, alloc/commit, staged
bind) each writer takes.  Against real daemon processes and real shared memory.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable

from lmcache_client import PutStatus, calls

from ...conftest import NAMESPACE, Daemon

MiB = 1 << 20


def key(i: int, tag: str = "race") -> bytes:
    return hashlib.sha256(f"{tag}-{i}".encode()).digest()


def value(k: bytes, who: str, size: int = 64 << 10) -> bytes:
    return hashlib.shake_128(who.encode() + k).digest(size)


def test_a_frames_put_during_an_uncommitted_alloc_of_the_same_key_is_exists(daemon: Daemon) -> None:
    """The shm writer allocated K first: a frames put of K before its commit was
    told STORED, and so was the commit (the frames copy then lost silently)."""
    k = key(0, "alloc-first")
    shm_bytes, frames_bytes = value(k, "shm"), value(k, "frames")
    with daemon.client(address=daemon.ipc_address) as shm_client, daemon.client(shared_memory=False) as frames_client:
        assert shm_client.uses_shared_memory
        pool = shm_client._pool
        assert pool is not None
        grant = shm_client._run(calls.alloc(NAMESPACE, [k], [len(shm_bytes)], pool.segment))
        loc = grant.loc[0]
        assert loc is not None
        pool.view[loc[0] : loc[0] + loc[1]] = shm_bytes
        framed = frames_client.put([k], [frames_bytes])
        committed = shm_client._run(calls.commit(grant.lease, pool.segment))
        # The alloc reserved K first: it is the first writer, the frames put the later one.
        assert (framed[0], committed[0]) == (PutStatus.EXISTS, PutStatus.STORED)
        assert bytes(frames_client.get([k])[0]) == shm_bytes


def _race(daemon: Daemon, rounds: int, n: int, size: int) -> list[tuple[bytes, PutStatus, PutStatus, bytes]]:
    """Two replicas, one over payload frames (tcp), one over shared memory (ipc,
    staged puts after its first), put the same ``n`` keys at the same moment,
    ``rounds`` times; per key: (key, frames status, shm status, bytes read back)."""
    out: list[tuple[bytes, PutStatus, PutStatus, bytes]] = []
    with daemon.client(address=daemon.ipc_address) as shm_client, daemon.client(shared_memory=False) as frames_client:
        assert shm_client.uses_shared_memory
        shm_client.put([key(-1, "warmup")], [value(key(-1, "warmup"), "shm", size)])  # stages slots
        for r in range(rounds):
            keys = [key(r * n + i, f"race-{size}") for i in range(n)]
            statuses: dict[str, list[PutStatus | int]] = {}
            gate = threading.Barrier(2)

            def writer(
                who: str,
                put: Callable[..., list[PutStatus | int]],
                keys: list[bytes],
                gate: threading.Barrier,
                statuses: dict[str, list[PutStatus | int]],
            ) -> None:
                payloads = [value(k, who, size) for k in keys]
                gate.wait()
                statuses[who] = put(keys, payloads)

            threads = [
                threading.Thread(target=writer, args=(who, put, keys, gate, statuses))
                for who, put in (("frames", frames_client.put), ("shm", shm_client.put))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            got = frames_client.get(keys)
            for i, k in enumerate(keys):
                stored = got[i]
                assert stored is not None
                out.append((k, PutStatus(statuses["frames"][i]), PutStatus(statuses["shm"][i]), bytes(stored)))
    return out


def test_two_replicas_racing_on_the_same_keys_get_exactly_one_stored_each(daemon: Daemon) -> None:
    """Issue 29 item 12: one frames replica and one shared-memory replica put the
    same keys at once; per key exactly one is STORED, the other EXISTS, and the
    daemon holds the winner's bytes."""
    both = []
    for k, framed, shared, stored in _race(daemon, rounds=40, n=16, size=256 << 10):
        assert sorted([framed, shared]) == sorted([PutStatus.STORED, PutStatus.EXISTS]), (k.hex(), framed, shared)
        winner = "frames" if framed == PutStatus.STORED else "shm"
        if stored != value(k, winner, 256 << 10):
            both.append(k.hex())
    assert not both, f"{len(both)} keys hold the loser's bytes"


def test_a_put_of_another_size_replaces_a_stored_chunk_once_it_has_no_readers(daemon: Daemon) -> None:
    """Issue 29 item 13: a chunk stored with the wrong size answered every re-store
    EXISTS and every load as a miss, for ever.  A put of another size replaces it
    (counted in the memory tier's stats), but not while a reader holds it."""
    k = key(0, "wrong-size")
    wrong, right = value(k, "other-layout", 1000), value(k, "engine", 4096)
    with daemon.client(address=daemon.ipc_address) as reader, daemon.client(shared_memory=False) as c:
        assert c.put([k], [wrong]) == [PutStatus.STORED]
        assert reader.uses_shared_memory
        pool = reader._pool
        assert pool is not None
        held = reader._run(calls.get_shm(NAMESPACE, [k], pool.segment))  # a read lease on the old bytes
        assert held.lease is not None
        assert c.put([k], [right]) == [PutStatus.EXISTS]  # a reader may be reading it: kept
        reader._run(calls.release([held.lease]))
        assert c.put([k], [right]) == [PutStatus.STORED]
        assert bytes(c.get([k])[0]) == right
        assert c.put([k], [right]) == [PutStatus.EXISTS]  # the same size: first writer wins again
        assert c.stats()["tiers"]["memory"]["replaced_wrong_size"] == 1
