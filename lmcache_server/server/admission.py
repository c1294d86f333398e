"""Admission control: an in-flight byte budget that answers BUSY instead of queueing.

Primitive: :class:`ByteBudget` (``try_acquire``, ``release``, ``in_use``).
"""

from __future__ import annotations


class ByteBudget:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.in_use = 0

    def try_acquire(self, nbytes: int) -> bool:
        """Take ``nbytes`` if they fit.  An idle budget admits one request of any
        size, so a request larger than the budget is slow, never starved."""
        if self.in_use and self.in_use + nbytes > self.max_bytes:
            return False
        self.in_use += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.in_use -= nbytes
        assert self.in_use >= 0, "byte budget released more than it lent"
