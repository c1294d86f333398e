"""Extent allocator over one fixed-size pool: best fit, coalescing, page-aligned.

KV chunks are large (MiBs) and mostly of a handful of sizes, so a contiguous
best-fit allocator with immediate coalescing keeps external fragmentation low
while letting every chunk be one contiguous range (one zero-copy frame, one
DMA).  Offsets and sizes are multiples of ALIGNMENT.

Primitives: :meth:`ExtentAllocator.alloc` (offset or None: no room),
:meth:`ExtentAllocator.free`, :meth:`ExtentAllocator.occupy` and
:meth:`ExtentAllocator.with_used` (the given extents in use: a pool adopted at a
warm restart), and the
accounting properties
(``allocated_bytes``, ``free_bytes``, ``largest_free``, ``fragmentation``).

Cost: O(log n + n_free) per call, with n_free the number of free extents
(a few hundred at most for a pool of MiB-sized chunks).

Memory: the allocator keeps the free extents only.  By default it also
remembers the size of each extent it handed out (a dict slot and an int per
extent: ~140 B per chunk at 100k chunks), so that ``free(offset)`` needs no
size; an owner that keeps the sizes itself (the memory tier: every chunk's
entry has its extent) builds it with ``track_sizes=False`` and passes the
size to ``free``.
"""

from __future__ import annotations

import bisect

ALIGNMENT = 4096


def aligned(size: int) -> int:
    return (size + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def extent_of(size: int) -> int:
    """Bytes :meth:`ExtentAllocator.alloc` hands out for ``size`` bytes."""
    return aligned(max(size, 1))


class ExtentAllocator:
    def __init__(self, capacity: int, track_sizes: bool = True):
        self.capacity = capacity // ALIGNMENT * ALIGNMENT
        if self.capacity <= 0:
            raise ValueError(f"pool of {capacity} bytes is smaller than one {ALIGNMENT}-byte page")
        self._by_start: dict[int, int] = {0: self.capacity}  # start -> size
        self._by_end: dict[int, int] = {self.capacity: 0}  # end -> start
        self._sizes: list[tuple[int, int]] = [(self.capacity, 0)]  # sorted (size, start)
        self._used: dict[int, int] | None = {} if track_sizes else None  # start -> size of live allocations
        self.allocated_bytes = 0

    @classmethod
    def with_used(cls, capacity: int, extents: list[tuple[int, int]], track_sizes: bool = True) -> ExtentAllocator:
        """An allocator over ``capacity`` bytes in which each ``(offset, size)`` of
        ``extents`` is allocated and the gaps between them are free (:meth:`occupy`)."""
        allocator = cls(capacity, track_sizes)
        allocator.occupy(extents)
        return allocator

    def occupy(self, extents: list[tuple[int, int]]) -> None:
        """Mark each ``(offset, size)`` of ``extents`` allocated, the gaps between them
        free: an empty allocator takes over a pool whose extents are in use (a warm
        restart's adoption).  Raises ValueError when something is allocated already,
        or for an extent that is unaligned, outside the pool or overlapping another
        (the allocator is then left as it was)."""
        if self.allocated_bytes:
            raise ValueError("only an empty allocator can take over used extents")
        by_start: dict[int, int] = {}
        used: list[tuple[int, int]] = []
        cursor = 0
        for offset, size in sorted(extents):
            if offset % ALIGNMENT or size <= 0 or size % ALIGNMENT:
                raise ValueError(f"extent ({offset}, {size}) is not page-aligned")
            if offset < cursor:
                raise ValueError(f"extent at {offset} overlaps the one before it")
            if offset + size > self.capacity:
                raise ValueError(f"extent ({offset}, {size}) ends past the pool's {self.capacity} bytes")
            if offset > cursor:
                by_start[cursor] = offset - cursor
            used.append((offset, size))
            cursor = offset + size
        if cursor < self.capacity:
            by_start[cursor] = self.capacity - cursor
        self._by_start.clear()
        self._by_end.clear()
        self._sizes.clear()
        for start, size in by_start.items():
            self._add_free(start, size)
        for offset, size in used:
            if self._used is not None:
                self._used[offset] = size
            self.allocated_bytes += size

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.allocated_bytes

    @property
    def largest_free(self) -> int:
        return self._sizes[-1][0] if self._sizes else 0

    @property
    def free_extents(self) -> int:
        return len(self._sizes)

    @property
    def fragmentation(self) -> float:
        """1 - largest free extent / free bytes: 0 when free space is one extent."""
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free / free

    def alloc(self, size: int) -> int | None:
        """Offset of a new extent of at least ``size`` bytes, or None when no free extent fits."""
        need = aligned(max(size, 1))
        i = bisect.bisect_left(self._sizes, (need, -1))
        if i == len(self._sizes):
            return None
        extent_size, start = self._sizes.pop(i)
        del self._by_start[start]
        del self._by_end[start + extent_size]
        if extent_size > need:
            self._add_free(start + need, extent_size - need)
        if self._used is not None:
            self._used[start] = need
        self.allocated_bytes += need
        return start

    def free(self, offset: int, size: int | None = None) -> None:
        """Give back the extent at ``offset``; ``size`` is the size it was
        allocated for (required when the allocator does not track sizes; ignored
        when it does).  Raises KeyError (tracked) or ValueError for an extent
        that is not allocated, as far as the free lists can tell."""
        if self._used is not None:
            size = self._used.pop(offset)
        elif size is None:
            raise TypeError("this allocator does not track sizes: free(offset, size)")
        else:
            size = extent_of(size)
            if offset in self._by_start or offset + size in self._by_end or offset + size > self.capacity:
                raise ValueError(f"extent ({offset}, {size}) is not allocated")
            if size > self.allocated_bytes:
                raise ValueError(f"extent ({offset}, {size}) is larger than all allocated bytes")
        self.allocated_bytes -= size
        start, end = offset, offset + size
        # Coalesce with the free neighbours on both sides.
        before = self._by_end.get(start)
        if before is not None:
            self._remove_free(before, start - before)
            start = before
        after_size = self._by_start.get(end)
        if after_size is not None:
            self._remove_free(end, after_size)
            end += after_size
        self._add_free(start, end - start)

    def size_of(self, offset: int) -> int:
        """Bytes allocated at ``offset`` (only when the allocator tracks sizes)."""
        if self._used is None:
            raise TypeError("this allocator does not track sizes")
        return self._used[offset]

    def _add_free(self, start: int, size: int) -> None:
        self._by_start[start] = size
        self._by_end[start + size] = start
        bisect.insort(self._sizes, (size, start))

    def _remove_free(self, start: int, size: int) -> None:
        del self._by_start[start]
        del self._by_end[start + size]
        i = bisect.bisect_left(self._sizes, (size, start))
        del self._sizes[i]
