"""A client process for the shared-memory tests (run as a script).

``worker ADDRESS NS ID N SIZE ROUNDS``: puts N chunks of its own, then reads
chunks of every worker for ROUNDS rounds, checking each hit's bytes against
the content every worker derives from the key; prints a JSON summary and
exits 1 on a wrong byte.

``hold ADDRESS NS KEY_HEX``: takes a read lease on KEY and a write lease on a
fresh key over shared memory, prints "held", then sleeps until killed.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

from lmcache_client import CacheClient, calls, shm


def key_of(worker: int, i: int) -> bytes:
    return hashlib.sha256(f"shm-worker-{worker}-{i}".encode()).digest()


def content(key: bytes, size: int) -> bytes:
    return hashlib.shake_128(key).digest(size)


def worker(address: str, ns: str, wid: int, n: int, size: int, rounds: int, workers: int) -> int:
    with CacheClient(address, ns, timeout_s=20, fail_open=False) as c:
        if not c.uses_shared_memory:
            print(json.dumps({"error": "no shared memory"}))
            return 2
        mine = [key_of(wid, i) for i in range(n)]
        statuses = c.put(mine, [content(k, size) for k in mine])
        hits = misses = wrong = 0
        for r in range(rounds):
            other = (wid + r) % workers
            keys = [key_of(other, i) for i in range(n)]
            out = [bytearray(size) for _ in keys]
            for key, buf, ok in zip(keys, out, c.get_into(keys, out)):
                if not ok:
                    misses += 1
                elif bytes(buf) != content(key, size):
                    wrong += 1
                else:
                    hits += 1
            for key, got in zip(keys, c.get(keys)):
                if got is not None and bytes(got) != content(key, size):
                    wrong += 1
        stored = sum(int(s) == 0 for s in statuses)
        print(json.dumps({"stored": stored, "hits": hits, "misses": misses, "wrong": wrong}))
        return 1 if wrong else 0


def hold(address: str, ns: str, key_hex: str) -> int:
    c = CacheClient(address, ns, timeout_s=20, fail_open=False)
    pool = c._shared_pool()
    assert pool is not None
    read = c._run(calls.get_shm(ns, [bytes.fromhex(key_hex)], pool.segment))
    never = [hashlib.sha256(b"never committed").digest()]
    write = c._run(calls.alloc(ns, never, [1 << 20], pool.segment, shm.owner()))  # as put_flow does
    print("held", read.lease is not None, write.lease is not None, flush=True)
    time.sleep(3600)
    return 0


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "worker":
        address, ns, wid, n, size, rounds, workers = args
        sys.exit(worker(address, ns, int(wid), int(n), int(size), int(rounds), int(workers)))
    sys.exit(hold(*args))
