"""Pages and GB/s per prefetch and backup call of the SGLang backend, for SGLang's ``get_stats``.

Primitive: :class:`TransferStats`.
"""

from __future__ import annotations

import threading
import time
from collections import deque

MAX_STATS_SAMPLES = 4096
"""Per-transfer samples kept for ``get_stats`` between two reads (oldest dropped)."""


class TransferStats:
    """Pages and GB/s per prefetch and backup call, drained by ``get_stats``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: dict[str, deque[tuple[int, float]]] = {
            op: deque(maxlen=MAX_STATS_SAMPLES) for op in ("prefetch", "backup")
        }

    def add(self, op: str, pages: int, page_bytes: int, started: float) -> None:
        elapsed_s = time.perf_counter() - started
        gb_per_s = pages * page_bytes / elapsed_s / 1e9 if elapsed_s > 0 else 0.0
        with self._lock:
            self._samples[op].append((pages, gb_per_s))

    def take(self) -> dict[str, list[tuple[int, float]]]:
        with self._lock:
            out = {op: list(samples) for op, samples in self._samples.items()}
            for samples in self._samples.values():
                samples.clear()
        return out
