"""A count-min sketch of chunk accesses: TinyLFU's frequency estimate, in bounded memory.

The lower tiers' ``frequency`` gate (:mod:`..tiered.gate`) asks how often
a chunk was used lately, for chunks the memory tier no longer holds too, so
the estimate cannot live in per-chunk state.  The sketch is ``ROWS`` rows of
``width`` one-byte counters (a ``bytearray``: ``ROWS x width`` bytes, fixed at
construction, whatever the number of keys):

- ``increment(h)`` adds one access of the key whose 64-bit hash is ``h``
  (:func:`.history.key_hash`): one counter per row, picked by double hashing
  of the hash's two 32-bit halves, and only the counters at the row minimum
  are raised (conservative update: fewer over-counts than raising all four).
  Counters saturate at ``MAX_COUNT`` (15: what TinyLFU's 4-bit counters hold).
- ``estimate(h)``: the smallest of the key's counters, an upper bound of its
  accesses since the last agings (collisions only ever add).
- Aging: after ``sample_size`` increments (``sample_factor x width``, 10x by
  default) every counter is halved (one ``bytes.translate``), so the sketch
  follows a changing workload: a chunk popular an hour ago fades.

Primitives: :class:`FrequencySketch` (``increment``, ``estimate``, ``nbytes``,
``stats``), ``MAX_COUNT``.
"""

from __future__ import annotations

ROWS = 4
MAX_COUNT = 15
"""A counter's ceiling (TinyLFU's 4-bit counters); admission compares small counts."""
_HALVED = bytes(i >> 1 for i in range(256))
_MASK32 = (1 << 32) - 1


class FrequencySketch:
    """A count-min sketch over 64-bit key hashes, aged by halving (see the module)."""

    def __init__(self, width: int = 1 << 16, sample_factor: int = 10):
        if width < 16 or width & (width - 1):
            raise ValueError(f"sketch width must be a power of two >= 16, not {width}")
        if sample_factor < 1:
            raise ValueError(f"sample_factor must be at least 1, not {sample_factor}")
        self.width = width
        self.sample_size = sample_factor * width
        """Increments between two agings (halvings of every counter)."""
        self._mask = width - 1
        self._table = bytearray(ROWS * width)
        self._increments = 0
        self.agings = 0

    def _slots(self, h: int) -> list[int]:
        low, high = h & _MASK32, (h >> 32) | 1
        mask, width = self._mask, self.width
        return [row * width + ((low + row * high) & mask) for row in range(ROWS)]

    def increment(self, h: int) -> None:
        """Count one access of the key hashed ``h``."""
        table = self._table
        slots = self._slots(h)
        low = min(table[s] for s in slots)
        if low < MAX_COUNT:
            for s in slots:
                if table[s] == low:
                    table[s] = low + 1
        self._increments += 1
        if self._increments >= self.sample_size:
            self._age()

    def estimate(self, h: int) -> int:
        """Accesses of the key hashed ``h`` lately (an upper bound; 0..MAX_COUNT)."""
        table = self._table
        return min(table[s] for s in self._slots(h))

    def _age(self) -> None:
        self._table = bytearray(self._table.translate(_HALVED))
        self._increments //= 2
        self.agings += 1

    @property
    def nbytes(self) -> int:
        """Bytes of counters: ``ROWS x width``, fixed at construction."""
        return len(self._table)

    def stats(self) -> dict[str, int]:
        return {"sketch_bytes": self.nbytes, "sketch_agings": self.agings}
