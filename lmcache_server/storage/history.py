"""A compact, bounded history of keys: what the policies remember of evicted and refused chunks.

The policies keep several keys per cached chunk here (lfuda: 8 evicted keys per
chunk; the adaptive head rule: 4 refused ones), so an entry must cost bytes,
not a Python object: a dict or OrderedDict of hashes costs 90 to 140 bytes per
key, which at a million cached chunks is gigabytes.  :class:`KeyHistory`
stores 8-byte fingerprints (the key's ``hash``) in a flat ``bytearray`` table
of 16-slot buckets, plus an optional 4-byte value per slot (a frequency):
12 bytes per remembered key (8 without values), at most 1.5x that while it
grows.

Primitives: :func:`key_hash` (a chunk key's 64-bit hash, the same in every
process), ``bound(limit)`` (how many keys to keep, at least), ``add(h,
value)``, ``pop(h)`` (the value, 0 if not remembered), ``h in history``,
``len(history)``.

Semantics, next to an OrderedDict with the oldest popped beyond the limit:

- Forgetting is per bucket: a full bucket overwrites its slots in turn (a
  ring), so the key forgotten is one of the oldest of its bucket, not exactly
  the oldest of all; with random hashes and 16-slot buckets the history holds
  the limit's worth of recent keys all the same.  A table of at most 16 keys
  is one bucket: exactly oldest-first.
- Growing (the limit rose above the table): a new table of 1.5x the limit
  takes the new keys; the old one is still searched until the new one has
  taken as many keys as the old one held, then dropped whole (its keys were
  the oldest).  No rehash, so no pause.  A lower limit keeps the table.
- Which keys share a bucket depends on the hashes, so they must not depend on
  the process (Python salts ``hash`` of strings): :func:`key_hash` mixes the
  digest with a CRC of the namespace, and the daemon forgets what an offline
  model of it (benchmarks/policy_sim.py) forgets.
- Two keys with the same 64-bit hash are one entry (the chance of a
  collision among millions of keys is about 1e-7; a policy then merely
  misjudges one key's history).
"""

from __future__ import annotations

import array
import zlib

from .base import ChunkKey

_SLOTS = 16  # per bucket
_ROW = 8 * _SLOTS  # bytes of fingerprints per bucket
_ZERO = bytes(8)  # an empty slot
_MASK = (1 << 64) - 1
_MAX_VALUE = (1 << 32) - 1
_GROWTH = 1.5


_namespace_crcs: dict[str, int] = {}


def key_hash(key: ChunkKey) -> int:
    """A 64-bit hash of ``key``, the same in every process (splitmix64's finaliser
    over the digest's 64-bit words and the namespace's CRC-32)."""
    crc = _namespace_crcs.get(key.namespace)
    if crc is None:
        if len(_namespace_crcs) > 4096:
            _namespace_crcs.clear()
        crc = _namespace_crcs[key.namespace] = zlib.crc32(key.namespace.encode("utf-8", "surrogatepass")) << 16
    x = int.from_bytes(key.digest, "little")
    z = crc
    while x:
        z ^= x & _MASK
        x >>= 64
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
    return z ^ (z >> 31)


def _fingerprint(h: int) -> bytes:
    return ((h & _MASK) or 1).to_bytes(8, "little")


class _Table:
    __slots__ = ("buckets", "fps", "values", "ring", "count", "inserts")

    def __init__(self, capacity: int, with_values: bool) -> None:
        self.buckets = max(1, -(-capacity // _SLOTS))
        self.fps = bytearray(self.buckets * _ROW)
        self.values = array.array("I", bytes(4 * self.buckets * _SLOTS)) if with_values else None
        self.ring = bytearray(self.buckets)  # per bucket: the slot a full bucket overwrites next
        self.count = 0  # slots in use
        self.inserts = 0

    @property
    def capacity(self) -> int:
        return self.buckets * _SLOTS

    def start(self, fp: bytes) -> int:
        """Where the bucket of ``fp`` begins (Fibonacci hashing: any 64 bits spread)."""
        return ((int.from_bytes(fp, "little") * 0x9E3779B97F4A7C15 & _MASK) >> 32) % self.buckets * _ROW

    def find(self, fp: bytes, start: int) -> int:
        """The byte offset of ``fp``'s slot in the bucket at ``start``, or -1."""
        fps, end = self.fps, start + _ROW
        i = fps.find(fp, start, end)
        while i >= 0 and (i - start) & 7:  # a match across two slots
            i = fps.find(fp, i + 1, end)
        return i

    def take(self, i: int) -> int:
        """Empty the slot at byte offset ``i``; its value."""
        self.fps[i : i + 8] = _ZERO
        self.count -= 1
        return self.values[i >> 3] if self.values is not None else 1

    def put(self, fp: bytes, start: int, value: int) -> None:
        i = self.find(_ZERO, start)
        if i < 0:  # full: overwrite the bucket's slots in turn
            bucket = start // _ROW
            slot = self.ring[bucket]
            self.ring[bucket] = (slot + 1) % _SLOTS
            i = start + 8 * slot
        else:
            self.count += 1
        self.fps[i : i + 8] = fp
        if self.values is not None:
            self.values[i >> 3] = min(value, _MAX_VALUE)
        self.inserts += 1


class KeyHistory:
    """A bounded set of key hashes, each with an optional small value (see the module docstring)."""

    __slots__ = ("_with_values", "_new", "_old")

    def __init__(self, limit: int, with_values: bool = True) -> None:
        self._with_values = with_values
        self._new = _Table(limit, with_values)
        self._old: _Table | None = None

    def bound(self, limit: int) -> None:
        """Keep at least the ``limit`` most recent keys from now on."""
        if limit > self._new.capacity:
            self._old = self._new
            self._new = _Table(int(limit * _GROWTH), self._with_values)

    def _locate(self, fp: bytes) -> tuple[_Table, int] | None:
        new = self._new
        if not new.count and self._old is None:
            return None  # empty (a tier being rebuilt: a million lookups for nothing)
        i = new.find(fp, new.start(fp))
        if i >= 0:
            return new, i
        old = self._old
        if old is not None:
            i = old.find(fp, old.start(fp))
            if i >= 0:
                return old, i
        return None

    def add(self, h: int, value: int = 1) -> None:
        """Remember the key of hash ``h`` (with ``value``), as the most recent."""
        fp = _fingerprint(h)
        found = self._locate(fp)
        if found is not None:
            found[0].take(found[1])
        new = self._new
        new.put(fp, new.start(fp), value)
        old = self._old
        if old is not None and new.inserts >= old.capacity:
            self._old = None  # everything in it is older than the new table's keys

    def pop(self, h: int) -> int:
        """Forget the key of hash ``h``; its value (0: it was not remembered)."""
        found = self._locate(_fingerprint(h))
        return 0 if found is None else found[0].take(found[1])

    def __contains__(self, h: object) -> bool:
        return isinstance(h, int) and self._locate(_fingerprint(h)) is not None

    def __len__(self) -> int:
        return self._new.count + (self._old.count if self._old is not None else 0)

    @property
    def nbytes(self) -> int:
        """Bytes its tables take."""
        tables = [self._new] + ([self._old] if self._old is not None else [])
        return sum(len(t.fps) + len(t.ring) + (4 * len(t.values) if t.values is not None else 0) for t in tables)
