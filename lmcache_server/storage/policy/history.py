"""A compact, bounded history of keys: what the policies remember of evicted and refused chunks.

The policies keep several keys per cached chunk here (lfuda: 8 evicted keys per
chunk; the adaptive head rule: 4 refused ones), so an entry must cost bytes,
not a Python object: a dict or OrderedDict of hashes costs 90 to 140 bytes per
key, which at a million cached chunks is gigabytes.  :class:`KeyHistory`
stores 4-byte fingerprints of the key's 64-bit hash in a flat ``bytearray``
table of 64-slot buckets (the bucket holds more of the hash's bits), plus an
optional 2-byte value per slot (a frequency, capped at 65535): 6 bytes per
remembered key (4 without values), up to 1.125x that as the table is sized
with headroom, twice that while it grows.

Primitives: :func:`key_hash` (a chunk key's 64-bit hash, the same in every
process), ``bound(limit)`` (how many keys to keep, at least), ``add(h,
value)``, ``pop(h)`` (the value, 0 if not remembered), ``get(h)`` (the
same, keeping the key), ``h in history``, ``len(history)``.

Semantics, next to an OrderedDict with the oldest popped beyond the limit:

- Forgetting is per bucket: each bucket is kept oldest first (a removal
  moves the younger ones down: one memmove of at most 256 bytes), and a full
  bucket forgets its oldest, which is not exactly the oldest of all: with
  random hashes a bucket gets 64 +- 8 of the last limit's keys, so a few
  percent of the most recent ones are forgotten early and as many older
  ones kept instead (on the trace lfuda at 2% hits 0.1199 with it, 0.1204
  with an exact oldest-first history; 0.1168 with 32-slot buckets).  A table
  of at most 64 keys is one bucket: exactly oldest-first.
- Growing (the limit rose above the table): a new table of 1.125x the limit
  takes the new keys; the old one is still searched until the new one has
  taken as many keys as the old one held, then dropped whole (its keys were
  the oldest).  No rehash, so no pause.  A lower limit keeps the table.
- Which keys share a bucket depends on the hashes, so they must not depend on
  the process (Python salts ``hash`` of strings): :func:`key_hash` mixes the
  digest with a CRC of the namespace, and the daemon forgets what an offline
  model of it (benchmarks/policy_sim.py) forgets.
- A key whose fingerprint matches another's in its bucket is taken for it
  (64 slots x 2**-32: about 1.5e-8 per lookup); a policy then merely misjudges
  one key's history.
"""

from __future__ import annotations

import array
import zlib

from ..base import ChunkKey

_SLOTS = 64  # per bucket
_FP = 4  # bytes of a fingerprint: with the bucket, about 40 bits of the hash
_ROW = _FP * _SLOTS  # bytes of fingerprints per bucket
_ZERO = bytes(_FP)  # an empty slot
_MASK = (1 << 64) - 1
_MAX_VALUE = (1 << 16) - 1
_GROWTH = 1.125


_namespace_crcs: dict[str, int] = {}
_recent: dict[ChunkKey, int] = {}  # key -> key_hash(key), for the keys hashed lately
_RECENT_MAX = 1024


def key_hash(key: ChunkKey) -> int:
    """A 64-bit hash of ``key``, the same in every process (splitmix64's finaliser
    over the digest's 64-bit words and the namespace's CRC-32).

    A chunk put or evicted is hashed by every policy model that sees it (the
    tier's own history and each of ``adaptive``'s experts) within a few calls,
    so the hashes of the last ~1,000 keys are kept: ~80 ns a repeat against
    ~1.2 us to compute."""
    h = _recent.get(key)
    if h is None:
        h = _key_hash(key)
        if len(_recent) >= _RECENT_MAX:
            _recent.clear()
        _recent[key] = h
    return h


def _key_hash(key: ChunkKey) -> int:
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
    return (((h ^ (h >> 32)) & 0xFFFFFFFF) or 1).to_bytes(_FP, "little")


class _Table:
    """Buckets of ``slots`` fingerprints, each bucket oldest first: its live slots
    are its first ``used[b]``, the rest zero."""

    __slots__ = ("buckets", "slots", "row", "fps", "values", "used", "count", "inserts")

    def __init__(self, capacity: int, with_values: bool) -> None:
        self.slots = max(1, min(_SLOTS, capacity))  # a small table is one bucket: exactly oldest first
        self.buckets = max(1, -(-capacity // self.slots))
        self.row = _FP * self.slots
        self.fps = bytearray(self.buckets * self.row)
        self.values = array.array("H", bytes(2 * self.buckets * self.slots)) if with_values else None
        self.used = bytearray(self.buckets)  # live slots per bucket
        self.count = 0  # live slots in all
        self.inserts = 0

    @property
    def capacity(self) -> int:
        return self.buckets * self.slots

    def bucket(self, h: int) -> int:
        """The bucket of hash ``h`` (Fibonacci hashing: any 64 bits spread)."""
        return (((h & _MASK) * 0x9E3779B97F4A7C15 & _MASK) >> 32) % self.buckets

    def find(self, fp: bytes, b: int) -> int:
        """The slot of ``fp`` (its index in the table), or -1."""
        fps, start = self.fps, b * self.row
        end = start + _FP * self.used[b]
        i = fps.find(fp, start, end)
        while i >= 0 and (i - start) % _FP:  # a match across two slots
            i = fps.find(fp, i + 1, end)
        return i if i < 0 else i // _FP

    def take(self, slot: int, b: int) -> int:
        """Remove the fingerprint in ``slot`` of bucket ``b`` (younger ones move down); its value."""
        value = self.values[slot] if self.values is not None else 1
        self._shift_out(slot, b)
        return value

    def _shift_out(self, slot: int, b: int) -> None:
        last = b * self.slots + self.used[b]  # one past the bucket's youngest slot
        fps = self.fps
        fps[_FP * slot : _FP * (last - 1)] = fps[_FP * (slot + 1) : _FP * last]
        fps[_FP * (last - 1) : _FP * last] = _ZERO
        values = self.values
        if values is not None:
            values[slot : last - 1] = values[slot + 1 : last]
            values[last - 1] = 0
        self.used[b] -= 1
        self.count -= 1

    def put(self, fp: bytes, b: int, value: int) -> None:
        """Store ``fp`` as the youngest of bucket ``b`` (it is not there yet); a full
        bucket forgets its oldest."""
        if self.used[b] == self.slots:
            self._shift_out(b * self.slots, b)
        slot = b * self.slots + self.used[b]
        self.fps[_FP * slot : _FP * (slot + 1)] = fp
        if self.values is not None:
            self.values[slot] = min(value, _MAX_VALUE)
        self.used[b] += 1
        self.count += 1
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

    def _locate(self, h: int, fp: bytes) -> tuple[_Table, int, int] | None:
        """The table, slot and bucket of the key of hash ``h``, or None."""
        new = self._new
        if not new.count and self._old is None:
            return None  # empty (a tier being rebuilt: a million lookups for nothing)
        b = new.bucket(h)
        slot = new.find(fp, b)
        if slot >= 0:
            return new, slot, b
        old = self._old
        if old is not None:
            b = old.bucket(h)
            slot = old.find(fp, b)
            if slot >= 0:
                return old, slot, b
        return None

    def add(self, h: int, value: int = 1) -> None:
        """Remember the key of hash ``h`` (with ``value``), as the most recent."""
        fp = _fingerprint(h)
        found = self._locate(h, fp)
        if found is not None:
            found[0].take(found[1], found[2])
        new = self._new
        new.put(fp, new.bucket(h), value)
        old = self._old
        if old is not None and new.inserts >= old.capacity:
            self._old = None  # everything in it is older than the new table's keys

    def pop(self, h: int) -> int:
        """Forget the key of hash ``h``; its value (0: it was not remembered)."""
        found = self._locate(h, _fingerprint(h))
        return 0 if found is None else found[0].take(found[1], found[2])

    def get(self, h: int) -> int:
        """The value of the key of hash ``h`` (1 without values), 0 if not remembered; keeps it."""
        found = self._locate(h, _fingerprint(h))
        if found is None:
            return 0
        values = found[0].values
        return 1 if values is None else values[found[1]]

    def __contains__(self, h: object) -> bool:
        return isinstance(h, int) and self._locate(h, _fingerprint(h)) is not None

    def __len__(self) -> int:
        return self._new.count + (self._old.count if self._old is not None else 0)

    @property
    def nbytes(self) -> int:
        """Bytes its tables take."""
        tables = [self._new] + ([self._old] if self._old is not None else [])
        return sum(len(t.fps) + len(t.used) + (2 * len(t.values) if t.values is not None else 0) for t in tables)
