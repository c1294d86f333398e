"""The cost gate: load from the daemon only what loads faster than the engine computes it.

A load is worth it while reading a token's KV takes less time than computing
it.  That holds for a memory hit on a GPU, and can fail for a slow disk, a
far Redis or a tiny model on a CPU (users of every KV cache report file-tier
hits slower than recompute).  The gate learns both rates from what it sees:

- the **load rate**: tokens per second the workers loaded, from the stats they
  send with every step (``update_connector_output``: ``loaded_tokens`` and
  ``load_s``);
- the **prefill rate**: tokens per second the engine computed, from the time
  between two steps and the tokens the first one scheduled, counted only for
  steps that scheduled at least :attr:`CostGate.MIN_STEP_TOKENS` tokens (decode
  steps say little about prefill).

Both are exponentially weighted means.  Until each has :attr:`CostGate.MIN_SAMPLES`
samples the gate lets every load through; after that a load whose expected
time exceeds ``margin`` times the time to compute it is skipped (the request
computes its prompt) and counted (``loads_skipped_by_cost``).  The gate is off
unless ``cost_gate`` is set: loads then always run, as before.

Primitive: :class:`CostGate`.
"""

from __future__ import annotations

import time
from typing import Any


class CostGate:
    """Rates seen so far, and whether a load of ``n`` tokens pays."""

    ALPHA = 0.2
    """Weight of the newest sample in each mean."""
    MIN_SAMPLES = 3
    MIN_STEP_TOKENS = 128
    """Steps scheduling fewer tokens do not count towards the prefill rate."""

    def __init__(self, margin: float = 1.0, clock: Any = time.perf_counter):
        self.margin = margin
        self._clock = clock
        self.load_rate: float | None = None
        """Tokens per second loaded (workers' view)."""
        self.prefill_rate: float | None = None
        """Tokens per second computed by the engine."""
        self._load_samples = 0
        self._prefill_samples = 0
        self._last_step: tuple[float, int] | None = None

    @staticmethod
    def _mean(old: float | None, new: float) -> float:
        return new if old is None else (1 - CostGate.ALPHA) * old + CostGate.ALPHA * new

    def saw_load(self, tokens: float, seconds: float) -> None:
        """Workers loaded ``tokens`` tokens in ``seconds`` (one step's stats)."""
        if tokens > 0 and seconds > 0:
            self.load_rate = self._mean(self.load_rate, tokens / seconds)
            self._load_samples += 1

    def saw_step(self, scheduled_tokens: int) -> None:
        """A step was scheduled with ``scheduled_tokens`` tokens (called once per step)."""
        now = self._clock()
        if self._last_step is not None:
            started, tokens = self._last_step
            if tokens >= self.MIN_STEP_TOKENS and now > started:
                self.prefill_rate = self._mean(self.prefill_rate, tokens / (now - started))
                self._prefill_samples += 1
        self._last_step = (now, scheduled_tokens)

    @property
    def ready(self) -> bool:
        return self._load_samples >= self.MIN_SAMPLES and self._prefill_samples >= self.MIN_SAMPLES

    def pays(self, tokens: int) -> bool:
        """Whether loading ``tokens`` tokens is expected to beat computing them."""
        if tokens <= 0 or not self.ready or self.load_rate is None or self.prefill_rate is None:
            return True
        return tokens / self.load_rate <= self.margin * tokens / self.prefill_rate
