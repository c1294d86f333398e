"""Sizing telemetry: would a bigger memory pool help?  (docs/operations.md, "Would a bigger pool help?")

An unbounded cache misses only the first access of each distinct chunk, so over
a window of N chunk accesses with D distinct chunks its hit rate is
``(N - D) / N``: the *ceiling* no pool size can beat on that window.  Next to
it, the memory tier's *actual* hit rate over the same N accesses.  Ceiling well
above actual: a bigger pool (or a disk tier) would turn the gap into hits;
ceiling close to actual: the workload reuses no more, more memory buys nothing.

- D is counted by a :class:`HyperLogLog` sketch: 2**precision one-byte
  registers (16 KiB at the default precision 14), whatever the number of keys;
  relative standard error 1.04 / sqrt(2**precision) on D (0.81 % at 14), so the
  ceiling's absolute standard error is that times D / N (at most 0.0081).
  Below 2.5 * 2**precision distinct keys it counts by linear counting, whose
  error is a little smaller (1 / sqrt(2 m) while few registers are set: under
  one key at D = 100).
- The window (:class:`SizingWindow`) is a count of accesses, not of seconds:
  two sketches rotate, the *current* one takes accesses until it has
  ``window_chunks`` of them, then becomes the *previous* one and a fresh one
  starts.  The figures cover the previous and the current window together:
  the last ``window_chunks`` to ``2 * window_chunks`` accesses (since start, until
  the first rotation).  The distinct count of the two is the union of their
  registers (an element-wise max), so a chunk seen in both counts once; a scrape
  costs about 1 ms (the max is taken on big integers, not register by register).
- The ceiling is that of an unbounded cache *empty at the window's start*: a
  chunk cached before the window and read once in it is a hit for the real
  tier and a first access for the ceiling, so the actual rate can exceed the
  ceiling by a little when the window is short against the reuse distances.
- Rates are weighted by chunks; a chunk is chunk_size tokens, so they are the
  token hit rates (a shorter last chunk, where a client stores one, counts whole).
- Per access: one hash (Python's SipHash of the digest, which the bytes object
  caches: a lookup has hashed it already; xor the namespace's cached hash), a
  shift, a bit length and a compare; the hits are summed per batch.  The
  hash seed is per process (PYTHONHASHSEED): the error bound is over that random
  choice of hash function, so estimates are not reproducible across runs.

:class:`Sizing` holds one window per access stream: ``lookup`` (the chunks each
lookup asks about; a memory hit is a chunk of the leading hit run found in
memory) and ``get`` (the distinct chunks of each get; a memory hit is a chunk
the memory tier served without a lower tier).  Engines that look up before they
load (vLLM, SGLang) should be read on ``lookup``: their gets ask only for what
the lookup found, so ``get`` is near 1 for both figures.

Primitives: :class:`HyperLogLog` (``add``, ``estimate``, ``union_estimate``, ``clear``), :func:`register_max`,
:class:`SizingWindow` (``record``, ``stats``), :class:`Sizing` (``lookup``, ``get``, ``stats``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

_MASK64 = (1 << 64) - 1

DEFAULT_PRECISION = 14
"""16384 registers (16 KiB): relative standard error 0.81 % on the distinct count."""


class HyperLogLog:
    """A distinct-count sketch of 64-bit hashes (Flajolet et al. 2007, with linear
    counting below 2.5 m): ``m = 2**precision`` one-byte registers, fixed size."""

    def __init__(self, precision: int = DEFAULT_PRECISION):
        if not 4 <= precision <= 18:
            raise ValueError(f"precision must be 4..18, got {precision}")
        self.precision = precision
        self.registers = bytearray(1 << precision)

    @property
    def relative_error(self) -> float:
        """The standard error of :meth:`estimate`, relative to the true count."""
        return relative_error(self.precision)

    def add(self, h: int) -> None:
        """Count one 64-bit hash (the bits must look random: hash the key first)."""
        p = self.precision
        rank = 65 - p - ((h & _MASK64) >> p).bit_length()
        i = h & ((1 << p) - 1)
        if rank > self.registers[i]:
            self.registers[i] = rank

    def estimate(self) -> float:
        """The estimated number of distinct hashes added."""
        return _estimate(self.registers)

    def union_estimate(self, other: HyperLogLog) -> float:
        """The estimated number of distinct hashes added to either sketch."""
        if other.precision != self.precision:
            raise ValueError("sketches of different precision")
        return _estimate(register_max(self.registers, other.registers))

    def clear(self) -> None:
        self.registers[:] = bytes(len(self.registers))


def relative_error(precision: int) -> float:
    """HyperLogLog's relative standard error with ``2**precision`` registers."""
    return 1.04 / math.sqrt(1 << precision)


def register_max(a: bytes | bytearray, b: bytes | bytearray) -> bytes:
    """The element-wise max of two register arrays of equal length (the registers
    of the union), computed on them as two big integers, eight bits a lane: a
    Python loop over 16384 registers would stall a scrape for 4 milliseconds."""
    n = len(a)
    lanes = int.from_bytes(b"\xff" * n, "little")
    high = int.from_bytes(b"\x80" * n, "little")
    x, y = int.from_bytes(a, "little"), int.from_bytes(b, "little")
    # Registers are below 128: a lane of (x | high) - y is a + 128 - b > 0 (no borrow
    # between lanes), and its top bit is set exactly where a >= b.
    take_x = ((((x | high) - y) & high) >> 7) * 0xFF
    return ((x & take_x) | (y & ~take_x & lanes)).to_bytes(n, "little")


def _estimate(registers: bytes | bytearray) -> float:
    m = len(registers)
    # A histogram of register values (bytes.count runs in C), then the harmonic mean.
    counts = [registers.count(r) for r in range(max(registers) + 1)]
    raw = _alpha(m) * m * m / sum(c * 2.0**-r for r, c in enumerate(counts))
    zeros = counts[0]
    if raw <= 2.5 * m and zeros:
        return m * math.log(m / zeros)  # linear counting: exact-ish while most registers are empty
    return raw  # 64-bit hashes: no large-range correction needed


def _alpha(m: int) -> float:
    return {16: 0.673, 32: 0.697, 64: 0.709}.get(m, 0.7213 / (1 + 1.079 / m))


class SizingWindow:
    """One access stream's sliding window: accesses, memory hits, distinct chunks
    over the last ``window_chunks`` to ``2 * window_chunks`` accesses (see the module)."""

    def __init__(self, window_chunks: int, precision: int = DEFAULT_PRECISION):
        if window_chunks < 1:
            raise ValueError(f"window_chunks must be at least 1, got {window_chunks}")
        self.window_chunks = window_chunks
        self._current = HyperLogLog(precision)
        self._previous = HyperLogLog(precision)
        self._accesses = 0  # in the current window
        self._hits = 0
        self._previous_accesses = 0
        self._previous_hits = 0
        self.rotations = 0

    def record(self, namespace: str, digests: Sequence[bytes], hits: Sequence[bool]) -> None:
        """Count an access to each chunk ``(namespace, digest)``, a memory hit where
        ``hits`` (as long as ``digests``) is true."""
        if len(hits) != len(digests):
            raise ValueError(f"{len(digests)} digests but {len(hits)} hit flags")
        ns = hash(namespace)  # cached by the str; a digest's hash is cached by its bytes once a dict has seen it
        p = self._current.precision
        low = (1 << p) - 1
        top = 65 - p
        start = 0
        while start < len(digests):
            take = min(len(digests) - start, self.window_chunks - self._accesses)
            regs = self._current.registers
            for d in digests[start : start + take]:
                h = (hash(d) ^ ns) & _MASK64
                rank = top - (h >> p).bit_length()
                if rank > regs[h & low]:
                    regs[h & low] = rank
            self._accesses += take
            self._hits += sum(hits[start : start + take])
            start += take
            if self._accesses == self.window_chunks:
                self._rotate()

    def _rotate(self) -> None:
        self._previous, self._current = self._current, self._previous
        self._current.clear()
        self._previous_accesses, self._previous_hits = self._accesses, self._hits
        self._accesses = self._hits = 0
        self.rotations += 1

    def stats(self) -> dict[str, float]:
        """``accesses``, ``hits``, ``distinct`` (estimated), ``ceiling`` and ``actual``
        (hit rates, 0 when there were no accesses) over the window."""
        n = self._accesses + self._previous_accesses
        hits = self._hits + self._previous_hits
        if self._previous_accesses:
            distinct = self._current.union_estimate(self._previous)
        else:
            distinct = self._current.estimate()
        distinct = min(float(n), distinct)  # an estimate can overshoot; a count of n accesses cannot
        return {
            "accesses": n,
            "hits": hits,
            "distinct": round(distinct, 1),
            "ceiling": (n - distinct) / n if n else 0.0,
            "actual": hits / n if n else 0.0,
        }


class Sizing:
    """The store's windows: ``lookup`` and ``get`` (see the module), each of
    ``window_chunks`` accesses; the tiered store records into them."""

    def __init__(self, window_chunks: int, precision: int = DEFAULT_PRECISION):
        self.lookup = SizingWindow(window_chunks, precision)
        self.get = SizingWindow(window_chunks, precision)
        self.relative_error = relative_error(precision)

    def stats(self) -> dict[str, Any]:
        """Per stream (``lookup``, ``get``) the window's figures; and the sketch's relative error."""
        return {
            "window_chunks": self.lookup.window_chunks,
            "relative_error": round(self.relative_error, 4),
            "lookup": self.lookup.stats(),
            "get": self.get.stats(),
        }
