"""The tier gate: which chunks are worth writing below memory, to disk and to Redis.

Memory takes every put (its own policy decides, and admits, :mod:`..policy`).  Below
it each lower tier has a gate, in one of three modes (the config keys keep their
names: ``disk_admission``, ``remote_admission``; so do the counters in the stats,
``admitted`` and ``declined``):

- ``always``: every chunk, as before the gate existed: a chunk evicted from
  memory is spilled to disk; a chunk stored in memory is queued for Redis.
- ``reused``: only a chunk that was read (a get hit in any tier) since it was
  put, or was put again (a second put while it is in memory, or a put of a
  chunk dropped from memory earlier and remembered in a bounded history of
  keys).
- ``frequency``: a TinyLFU verdict from a count-min sketch of accesses (puts and
  get hits; :class:`..policy.sketch.FrequencySketch`): a chunk passes when
  its estimated frequency is at least 2 and, if the tier is full, greater than
  that of the tier's next victim (the chunk its write would evict).  Redis
  names no victim (its own memory policy and TTL decide), so there the rule is
  the frequency of at least 2 alone.

When each tier decides: the disk when memory evicts the chunk (the spill); a
declined chunk is dropped (counted in ``declined`` and ``declined_bytes``).
Redis when the chunk is stored in memory and, if declined then, again at each
later access while memory still holds it: passed then, it is queued for
Redis at that moment; a chunk that leaves memory without passing is
counted declined.  Keys already queued for Redis, or read from it, are
remembered (bounded, :class:`SentKeys`) so that a chunk is not written twice;
with ``remote_ttl_s`` only for that long, after which Redis has dropped the
chunk and a later access that passes it writes it again.

A delete forgets its keys; a ``clear`` of one namespace forgets that
namespace's keys and no other's (:class:`ClearEpochs`): the histories keep
hashes, not keys, so each namespace's keys are remembered under a hash salted
with the number of times it was cleared, and a clear moves its salt on (the old
entries are never found again and age out).  A clear of every namespace, or of
more distinct namespaces than :data:`MAX_CLEARED_NAMESPACES`, forgets every key.

The tiered store calls :class:`StoreGate` at those points (``stored``,
``accessed``, ``uplinked``, ``from_remote``, ``spill``, ``evicted``, ``removed``,
``deleted``); :class:`TierGate` is one
tier's rule and counters, :class:`Accesses` what both rules know of accesses.

Primitives: ``MODES``, :func:`sketch_width_for`, :class:`GateCounters`, :class:`Accesses`,
:class:`TierGate` (``passes``, ``count``), :class:`SentKeys`, :class:`ClearEpochs`,
:class:`StoreGate`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from ..base import ChunkKey
from ..policy import FrequencySketch, KeyHistory, key_hash

MODES = ("always", "reused", "frequency")
"""The values of ``disk_admission`` and ``remote_admission``."""
HISTORY_KEYS = 1 << 16
"""Keys remembered after they leave memory (a re-put is a reuse) and keys sent to Redis."""
MAX_CLEARED_NAMESPACES = 4096
"""Namespaces whose clears :class:`ClearEpochs` keeps apart; past it a clear forgets every key."""
_MASK = (1 << 64) - 1


def sketch_width_for(capacity_bytes: int) -> int:
    """The sketch's row width for tiers of ``capacity_bytes`` (memory + disk): one
    counter per MiB (chunks are MiBs), a power of two, 4096..2**21 (16 KiB..8 MiB)."""
    return 1 << max(12, min(21, (capacity_bytes >> 20).bit_length()))


@dataclasses.dataclass
class GateCounters:
    admitted: int = 0
    declined: int = 0
    declined_bytes: int = 0  # payload bytes not written to the tier


class ClearEpochs:
    """How many times each namespace was cleared, mixed into the hash the key
    histories remember its keys under (:meth:`hash`): a clear of one namespace
    (:meth:`cleared`) makes its remembered keys unfindable, and leaves every other
    namespace's alone.  Bounded: it keeps :data:`MAX_CLEARED_NAMESPACES` namespaces;
    a clear past that (or of every namespace) starts over, and its caller then
    forgets every key."""

    def __init__(self, limit: int = MAX_CLEARED_NAMESPACES) -> None:
        self._limit = limit
        self._epochs: dict[str, int] = {}

    def hash(self, key: ChunkKey) -> int:
        """``key``'s hash in the histories: :func:`key_hash`, salted once its namespace was cleared."""
        h = key_hash(key)
        epoch = self._epochs.get(key.namespace)
        if not epoch:
            return h
        z = (h ^ (epoch * 0x9E3779B97F4A7C15)) & _MASK  # splitmix64's finaliser over the salted hash
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
        return z ^ (z >> 31)

    def cleared(self, namespace: str | None) -> bool:
        """``namespace`` was cleared (None: every one).  False: its keys cannot be told
        apart (every namespace cleared, or too many namespaces cleared): forget every key."""
        if namespace is None or (namespace not in self._epochs and len(self._epochs) >= self._limit):
            self._epochs.clear()
            return False
        self._epochs[namespace] = self._epochs.get(namespace, 0) + 1
        return True


class Accesses:
    """What the gates' rules know of chunk accesses: a sketch of their
    frequency (``frequency``), and which chunks in memory were reused (``reused``).
    ``epochs``: the namespaces' clears, shared with :class:`SentKeys` (a new one if None)."""

    def __init__(
        self,
        sketch: FrequencySketch | None,
        track_reuse: bool,
        history_keys: int = HISTORY_KEYS,
        epochs: ClearEpochs | None = None,
    ):
        self.sketch = sketch
        self.track_reuse = track_reuse
        self._epochs = epochs if epochs is not None else ClearEpochs()
        self._reused: set[ChunkKey] = set()  # in memory, and read or put again since stored
        self._gone_limit = history_keys
        self._gone = KeyHistory(history_keys, with_values=False)  # key hashes (salted) that left memory

    def stored(self, key: ChunkKey) -> None:
        """``key`` was put and stored in memory (a chunk remembered as gone: a reuse)."""
        h = key_hash(key)
        if self.sketch is not None:
            self.sketch.increment(h)
        if self.track_reuse and self._gone.pop(self._epochs.hash(key)):
            self._reused.add(key)

    def accessed(self, key: ChunkKey, resident: bool = True) -> None:
        """``key`` was read (a hit in any tier) or put again.  ``resident``: memory
        holds it (or is filling it); else (a lower-tier hit memory had no room for)
        only the history of keys remembers it, so that the set of reused chunks
        never holds a key memory will not tell :meth:`left_memory` about."""
        h = key_hash(key)
        if self.sketch is not None:
            self.sketch.increment(h)
        if self.track_reuse:
            if resident:
                self._reused.add(key)
            else:
                salted = self._epochs.hash(key)
                if salted not in self._gone:
                    self._gone.add(salted)

    def left_memory(self, key: ChunkKey) -> None:
        if self.track_reuse:
            self._reused.discard(key)
            self._gone.add(self._epochs.hash(key))

    def forget(self, key: ChunkKey | None) -> None:
        """``key`` was deleted (None: every key, a clear of every namespace): a later
        put of it is a first put.  A clear of one namespace is :class:`ClearEpochs`' job."""
        if key is None:
            self._gone = KeyHistory(self._gone_limit, with_values=False)
        else:
            self._gone.pop(self._epochs.hash(key))

    def reused(self, key: ChunkKey) -> bool:
        return key in self._reused

    def frequency(self, key: ChunkKey) -> int:
        return self.sketch.estimate(key_hash(key)) if self.sketch is not None else 0


class TierGate:
    """One lower tier's rule (``mode``, one of :data:`MODES`) and its counters."""

    def __init__(self, tier: str, mode: str, accesses: Accesses):
        if mode not in MODES:
            raise ValueError(f"{tier} admission must be one of {', '.join(MODES)}, not {mode!r}")
        self.tier = tier
        self.mode = mode
        self.accesses = accesses
        self.counters = GateCounters()

    def passes(self, key: ChunkKey, victim: Callable[[], ChunkKey | None] | None = None) -> bool:
        """Whether ``key`` deserves a write to the tier now (nothing counted).
        ``victim``: the chunk the write would evict from the tier (None: it fits)."""
        if self.mode == "always":
            return True
        if self.mode == "reused":
            return self.accesses.reused(key)
        freq = self.accesses.frequency(key)
        if freq < 2:
            return False
        displaced = victim() if victim is not None else None
        return displaced is None or freq > self.accesses.frequency(displaced)

    def count(self, admitted: bool, nbytes: int) -> None:
        c = self.counters
        if admitted:
            c.admitted += 1
        else:
            c.declined += 1
            c.declined_bytes += nbytes

    def stats(self) -> dict[str, Any]:
        return {"admission": self.mode, **dataclasses.asdict(self.counters)}


class SentKeys:
    """Keys queued for Redis or read from it, so not written there again (the
    last :data:`HISTORY_KEYS`).

    With a Redis TTL (``ttl_s`` > 0) a key counts as sent for about that long
    (a little less: the send time is kept in 16 bits of ``ttl_s / 1024`` units
    and a key 1023 units old is forgotten): Redis has dropped it since, so it may
    be written again.  A key read from Redis is stamped at the read: Redis counts
    its expiry from the write, so such a key can expire there up to one TTL before
    this forgets it (a Redis miss in between, never a wrong byte).  An entry not
    looked at for 64 TTLs can pass for fresh again (the stamp wraps), with the
    same consequence."""

    _FRESH = 1023  # units of ttl_s / 1024

    def __init__(
        self, ttl_s: float = 0.0, clock: Callable[[], float] = time.monotonic, epochs: ClearEpochs | None = None
    ):
        self._unit = ttl_s / 1024 if ttl_s > 0 else 0.0
        self._clock = clock
        self._epochs = epochs if epochs is not None else ClearEpochs()  # keys under salted hashes
        self._keys = KeyHistory(HISTORY_KEYS, with_values=self._unit > 0)

    def _stamp(self) -> int:
        return int(self._clock() / self._unit) % 0xFFFF + 1  # 1..65535; 0 means absent

    def add(self, key: ChunkKey) -> None:
        self._keys.add(self._epochs.hash(key), self._stamp() if self._unit else 1)

    def discard(self, key: ChunkKey) -> None:
        self._keys.pop(self._epochs.hash(key))

    def clear(self) -> None:
        self._keys = KeyHistory(HISTORY_KEYS, with_values=self._unit > 0)

    def __contains__(self, key: object) -> bool:
        h = self._epochs.hash(key)  # type: ignore[arg-type]
        if not self._unit:
            return h in self._keys
        stamp = self._keys.get(h)
        if not stamp:
            return False
        if (self._stamp() - stamp) % 0xFFFF < self._FRESH:
            return True
        self._keys.pop(h)  # Redis has dropped it by now
        return False


class StoreGate:
    """The tiered store's gates: the disk's and Redis' rules over shared
    :class:`Accesses`.  ``remote_mode`` None: no Redis tier."""

    def __init__(
        self,
        disk_mode: str,
        remote_mode: str | None,
        sketch_width: int = 1 << 16,
        remote_ttl_s: float = 0.0,
        remote_name: str = "redis",
    ):
        modes = {disk_mode, remote_mode}
        sketch = FrequencySketch(sketch_width) if "frequency" in modes else None
        self._epochs = ClearEpochs()  # one namespace's clear forgets its keys in both histories
        self.accesses = Accesses(sketch, track_reuse="reused" in modes, epochs=self._epochs)
        self.disk = TierGate("disk", disk_mode, self.accesses)
        self.remote = TierGate(remote_name, remote_mode, self.accesses) if remote_mode is not None else None
        self._owed: dict[ChunkKey, int] = {}  # in memory, not (yet) admitted to Redis: key -> bytes
        self._sent = SentKeys(remote_ttl_s, epochs=self._epochs)  # queued for or read from Redis

    # -- Redis ---------------------------------------------------------------------
    def stored(self, key: ChunkKey, nbytes: int) -> bool:
        """A put stored ``key`` in memory: whether to queue it for Redis now."""
        self.accesses.stored(key)
        remote = self.remote
        if remote is None:
            return False
        if remote.mode == "always" or (key not in self._sent and remote.passes(key)):
            return True
        self._owed[key] = nbytes
        return False

    def accessed(self, key: ChunkKey, resident: bool = True) -> bool:
        """``key`` was read, or put again: whether to queue it for Redis now (not
        sent there before, and admitted now; the caller queues it if memory holds
        it).  ``resident``: memory holds the key, or a put of it is filling."""
        self.accesses.accessed(key, resident)
        remote = self.remote
        if remote is None or remote.mode == "always":
            return False
        return key not in self._sent and remote.passes(key)

    def uplinked(self, key: ChunkKey, nbytes: int) -> None:
        """``key`` was queued for Redis (counted admitted, remembered as sent)."""
        self._owed.pop(key, None)
        if self.remote is not None:
            self.remote.count(True, nbytes)
            if self.remote.mode != "always":
                self._sent.add(key)

    def from_remote(self, key: ChunkKey) -> None:
        """``key`` was read from Redis (it holds it: no write owed)."""
        self._owed.pop(key, None)
        if self.remote is not None and self.remote.mode != "always":
            self._sent.add(key)

    def deleted(self, key: ChunkKey) -> None:
        """``key`` was deleted from every tier, Redis too: it is no longer sent, so a
        later store of it goes to Redis again when admitted, and that store is a
        first put, not a reuse."""
        self.accesses.forget(key)
        self._sent.discard(key)

    def cleared(self, namespace: str | None) -> None:
        """``namespace`` was cleared from every tier, Redis too (None: every namespace):
        as :meth:`deleted` for each of its keys, and only its keys; called after the
        tiers' clears (the keys that left memory in them are forgotten too)."""
        if not self._epochs.cleared(namespace):
            self.accesses.forget(None)
            self._sent.clear()

    # -- disk, and leaving memory ----------------------------------------------------
    def spill(self, key: ChunkKey, nbytes: int, victim: Callable[[], ChunkKey | None], final: bool) -> bool:
        """Whether the chunk memory evicts goes to disk; counted when passed, or
        when declined and ``final`` (a declined *lent* chunk stays in memory)."""
        admitted = self.disk.passes(key, victim)
        if admitted or final:
            self.disk.count(admitted, nbytes)
        return admitted

    def evicted(self, key: ChunkKey) -> None:
        """Memory evicted ``key``: a Redis write still owed is declined for good."""
        nbytes = self._owed.pop(key, None)
        if nbytes is not None and self.remote is not None:
            self.remote.count(False, nbytes)

    def removed(self, key: ChunkKey) -> None:
        """``key`` left memory (evicted, deleted, cleared)."""
        self._owed.pop(key, None)
        self.accesses.left_memory(key)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tier name: its mode and counters (the sketch's size and agings with the disk's)."""
        out = {"disk": self.disk.stats()}
        if self.remote is not None:
            out[self.remote.tier] = self.remote.stats()
        if self.accesses.sketch is not None:
            out["disk"].update(self.accesses.sketch.stats())
        return out
