"""The daemon side of the shared-memory model test (tests/server/shm/test_shm_model.py):
one daemon's in-process pool, memory tier, tiered store and lease table, a
fake monotonic clock for the lease table, an in-process warm restart, and
the invariant checks on a pool (who owns which extent, which bytes each
readable chunk holds).  No sockets: the real classes, called as the request
handlers call them."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

from lmcache_server.server.shm import ShmLeases
from lmcache_server.server.shm import leases as shm_module
from lmcache_server.storage import Chunk, ChunkKey, MemoryPool, MemoryTier, TieredStore
from lmcache_server.storage.memory import UNBOUND, Reservation
from lmcache_server.storage.memory.allocator import ALIGNMENT, aligned
from lmcache_server.storage.memory.entry import unpack
from lmcache_server.storage.memory.warmstart import Adoption, WarmIndex, check, decode, encode
from lmcache_server.storage.policy import LRUPolicy

NS = "model"
POOL_PAGES = 16
TIMEOUT_S = 30.0


def digest(i: int) -> bytes:
    return hashlib.sha256(f"model-key-{i}".encode()).digest()


def size_of(i: int) -> int:
    """Chunk sizes of one to three pages, some not page multiples."""
    return (ALIGNMENT, 2 * ALIGNMENT, ALIGNMENT + 904, 3 * ALIGNMENT)[i % 4]


def value(i: int) -> bytes:
    """Key ``i``'s bytes: derived from the key, so a chunk read with another's bytes shows."""
    return hashlib.shake_128(digest(i)).digest(size_of(i))


KEY_OF = {digest(i): i for i in range(64)}


class FakeClock:
    """Stands in for the ``time`` module of server/shm/leases.py (only ``monotonic`` is used)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def alive_owner() -> dict[str, int]:
    """This process as a write lease's ``owner`` (observable and alive)."""
    with open("/proc/self/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])
    return {"pid": os.getpid(), "pidns": os.stat("/proc/self/ns/pid").st_ino, "start": start}


def dead_owner() -> dict[str, int]:
    """An observable owner that is gone (this pid with another start time)."""
    owner = alive_owner()
    owner["start"] += 1
    return owner


class Daemon:
    """One daemon's storage and lease table over ``pool`` (a new one adopts the pool)."""

    def __init__(self, pool: MemoryPool) -> None:
        self.pool = pool
        self.memory = MemoryTier(pool, 0, LRUPolicy())
        self.store = TieredStore(self.memory)
        self.shm = ShmLeases(self.store, pool, TIMEOUT_S)

    def warm_restart(self, clock: FakeClock) -> Daemon:
        """A clean stop and the next daemon's adoption of the pool (as app.py does,
        with the index through its file format and checks)."""
        leases = self.shm.hand_over()
        chunks = self.memory.snapshot()
        index = WarmIndex("segment", self.pool.size, ("model",), "boot", 0.0, chunks, leases)
        index = decode(encode(index))
        check(index, self.pool.size)
        nxt = Daemon.__new__(Daemon)
        nxt.pool = self.pool
        nxt.memory = MemoryTier(self.pool, 0, LRUPolicy())
        reads, writes = Adoption(None, index).restore(nxt.memory, now=clock.now)  # type: ignore[arg-type]
        nxt.store = TieredStore(nxt.memory)
        nxt.shm = ShmLeases(nxt.store, self.pool, TIMEOUT_S)
        nxt.shm.take_over(reads, writes)
        return nxt


def new_pool() -> MemoryPool:
    return MemoryPool(POOL_PAGES * ALIGNMENT, "off")


def live_chunks(memory: MemoryTier) -> Iterator[tuple[ChunkKey, int, int]]:
    """``(key, offset, size)`` of every chunk the memory tier serves."""
    for key, found in memory.index.entries.items():
        if isinstance(found, int):
            offset, size = unpack(found)
        else:
            offset, size = found.offset, found.size
        yield key, offset, size


def reservations(shm: ShmLeases) -> Iterator[tuple[str, Reservation]]:
    """Every write slot the lease table holds (live, staged or quarantined)."""
    for lease, w in shm.table.writes.items():
        for r in w.reservations:
            yield f"write lease {lease}", r
    for lease, q in shm.table.quarantine.items():
        for r in q.write.reservations:
            yield f"quarantined lease {lease}", r


def read_chunks(shm: ShmLeases) -> Iterator[tuple[int, int, Chunk]]:
    """``(lease, position, chunk)`` of every chunk a read lease holds."""
    for lease, r in shm.table.reads.items():
        for i, chunk in enumerate(r.chunks):
            yield lease, i, chunk


def check_extents(d: Daemon) -> None:
    """No pool extent owned twice, none owned yet free, none allocated yet unowned.

    Owners: each live chunk; each write slot; each extent read leases hold
    that is no live chunk's (a chunk deleted or evicted while leased: one
    owner however many leases hold it)."""
    owners: list[tuple[int, int, str]] = []
    live_at: dict[int, tuple[int, ChunkKey]] = {}
    for key, offset, size in live_chunks(d.memory):
        owners.append((offset, aligned(size), f"chunk {KEY_OF.get(key.digest)}"))
        live_at[offset] = (size, key)
    for who, r in reservations(d.shm):
        of = "no key (staged)" if r.key == UNBOUND else f"chunk {KEY_OF.get(r.key.digest)}"
        owners.append((r.offset, aligned(r.size), f"{who}: slot of {of}"))
    held: dict[int, int] = {}
    for lease, _, chunk in read_chunks(d.shm):
        assert chunk.offset is not None
        live = live_at.get(chunk.offset)
        if live is not None and live[0] == chunk.data.nbytes:
            continue
        if chunk.offset in held:
            assert held[chunk.offset] == chunk.data.nbytes, f"two read leases hold different extents at {chunk.offset}"
            continue
        held[chunk.offset] = chunk.data.nbytes
        owners.append((chunk.offset, aligned(chunk.data.nbytes), f"dead extent held by read lease {lease}"))
    owners.sort()
    for (o1, n1, w1), (o2, n2, w2) in zip(owners, owners[1:]):
        assert o1 + n1 <= o2, f"extent [{o1}, {o1 + n1}) of {w1} overlaps [{o2}, {o2 + n2}) of {w2}"
    allocator = d.memory.allocator
    for start, size in allocator._by_start.items():
        for offset, n, who in owners:
            assert offset + n <= start or start + size <= offset, (
                f"extent [{offset}, {offset + n}) of {who} is in the free extent [{start}, {start + size})"
            )
    owned = sum(n for _, n, _ in owners)
    assert allocator.allocated_bytes == owned, (
        f"allocator counts {allocator.allocated_bytes} bytes allocated, owners hold {owned}: {owners}"
    )


def check_bytes(d: Daemon, read_keys: dict[int, list[int]]) -> None:
    """Every live chunk reads its own key's bytes, and so does every chunk a read
    lease holds (``read_keys``: lease -> the keys its get was answered for)."""
    view = d.pool.view
    for key, offset, size in live_chunks(d.memory):
        i = KEY_OF[key.digest]
        assert bytes(view[offset : offset + size]) == value(i), f"chunk {i} at {offset} reads other bytes"
    for lease, position, chunk in read_chunks(d.shm):
        i = read_keys[lease][position]
        assert bytes(chunk.data) == value(i), f"read lease {lease} reads other bytes than chunk {i} at {chunk.offset}"


__all__ = [
    "NS",
    "TIMEOUT_S",
    "Daemon",
    "FakeClock",
    "alive_owner",
    "check_bytes",
    "check_extents",
    "dead_owner",
    "digest",
    "new_pool",
    "shm_module",
    "size_of",
    "value",
]
