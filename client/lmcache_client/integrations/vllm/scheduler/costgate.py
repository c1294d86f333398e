"""The cost gate: load from the daemon only what loads faster than the engine computes it.

A load is worth it while reading a token's KV takes less time than computing
it.  That holds for a memory hit on a GPU, and can fail for a slow disk, a
far Redis or a tiny model on a CPU (users of every KV cache report file-tier
hits slower than recompute).  The gate learns the rates from what it sees:

- the **load rate per tier**: seconds per token loaded, for each daemon tier
  the lookup named (``memory``, ``disk``, ``redis``).  A sample is one step's
  worker stats (``update_connector_output``: ``loaded_tokens``, ``load_s``)
  with the tier mix of the loads they cover (the requests whose loads the
  step's output reports finished, or, synchronously, the loads of the step's
  metadata).  A sample from one tier is that tier's cost; a mixed sample is
  split by the costs known so far (what the known tiers explain is theirs,
  the rest goes to the unknown ones; all known: each is scaled by the same
  factor).  The tier is the one the lookup reported, so a ``disk`` chunk that
  the daemon prefetched into memory while its request was parked counts at
  the speed it actually loaded: what the gate decides on is what a lookup
  answer will cost.  A global rate over every sample is kept too, for tiers
  with too few samples of their own;
- the **prefill rate**: tokens per second the engine computed, from the time
  between two steps and the tokens the first one scheduled, counted only for
  steps that scheduled at least :attr:`CostGate.MIN_STEP_TOKENS` tokens (decode
  steps say little about prefill).

All are exponentially weighted means.  Until the prefill rate has
:attr:`CostGate.MIN_SAMPLES` samples every load runs.  After that
:meth:`CostGate.plan` takes a load as its leading pieces (one per chunk, each
with its tier) and keeps the leading run that saves the most time: a chunk
costs ``tokens * cost[tier]`` to load and ``margin * tokens / prefill_rate``
to compute, so a run of memory hits followed by slow disk chunks loads the
memory part and computes the rest, and a slow first chunk before many fast
ones may still load when the run as a whole pays.  A tier with no usable rate
(neither its own nor the global one) is assumed to pay, so it gets measured.
The gate is off unless ``cost_gate`` is set: loads then always run, as before.

Primitive: :class:`CostGate`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any


class CostGate:
    """Rates seen so far, and how much of a load pays."""

    ALPHA = 0.2
    """Weight of the newest sample in each mean."""
    MIN_SAMPLES = 3
    MIN_STEP_TOKENS = 128
    """Steps scheduling fewer tokens do not count towards the prefill rate."""

    def __init__(self, margin: float = 1.0, clock: Any = time.perf_counter):
        if not margin > 0:
            raise ValueError(f"cost gate margin must be positive, not {margin!r}")
        self.margin = margin
        self._clock = clock
        self.load_rate: float | None = None
        """Tokens per second loaded, every tier together (workers' view)."""
        self.prefill_rate: float | None = None
        """Tokens per second computed by the engine."""
        self.tier_cost: dict[str, float] = {}
        """Seconds per token loaded, per tier the lookup named."""
        self.tier_samples: dict[str, int] = {}
        self._load_samples = 0
        self._prefill_samples = 0
        self._last_step: tuple[float, int] | None = None

    @staticmethod
    def _mean(old: float | None, new: float) -> float:
        return new if old is None else (1 - CostGate.ALPHA) * old + CostGate.ALPHA * new

    # -- learning --------------------------------------------------------------------------
    def saw_load(self, tokens: float, seconds: float, mix: Mapping[str, float] | None = None) -> None:
        """Workers loaded ``tokens`` tokens in ``seconds`` (one step's stats); ``mix``: the
        tokens of the loads they cover by tier (scaled to ``tokens``: under tensor
        parallelism every rank counts its tokens)."""
        if not (tokens > 0 and seconds > 0):
            return
        self.load_rate = self._mean(self.load_rate, tokens / seconds)
        self._load_samples += 1
        planned = sum(n for n in (mix or {}).values() if n > 0)
        if planned <= 0:
            return
        assert mix is not None
        scaled = {tier: n * tokens / planned for tier, n in mix.items() if n > 0}
        for tier, cost in self._split(scaled, seconds).items():
            self.tier_cost[tier] = self._mean(self.tier_cost.get(tier), cost)
            self.tier_samples[tier] = self.tier_samples.get(tier, 0) + 1

    def _split(self, tokens: Mapping[str, float], seconds: float) -> dict[str, float]:
        """Seconds per token of each tier in one mixed sample (the tiers it cannot tell: none)."""
        if len(tokens) == 1:
            ((tier, n),) = tokens.items()
            return {tier: seconds / n}
        known = {t: n for t, n in tokens.items() if self.tier_samples.get(t, 0) >= self.MIN_SAMPLES}
        unknown = {t: n for t, n in tokens.items() if t not in known}
        explained = sum(n * self.tier_cost[t] for t, n in known.items())
        if not unknown:
            factor = seconds / explained if explained > 0 else 1.0
            return {t: self.tier_cost[t] * factor for t in known}
        rest = seconds - explained
        if not known:
            return {t: seconds / sum(unknown.values()) for t in unknown}
        if rest <= 0:
            return {}  # the known tiers took all of it: nothing to say about the others
        per_token = rest / sum(unknown.values())
        return {t: per_token for t in unknown}

    def saw_step(self, scheduled_tokens: int) -> None:
        """A step was scheduled with ``scheduled_tokens`` tokens (called once per step)."""
        now = self._clock()
        if self._last_step is not None:
            started, tokens = self._last_step
            if tokens >= self.MIN_STEP_TOKENS and now > started:
                self.prefill_rate = self._mean(self.prefill_rate, tokens / (now - started))
                self._prefill_samples += 1
        self._last_step = (now, scheduled_tokens)

    # -- deciding --------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """The prefill rate and at least the global load rate are known."""
        return self._load_samples >= self.MIN_SAMPLES and self._prefill_samples >= self.MIN_SAMPLES

    def cost(self, tier: str | None) -> float | None:
        """Seconds per token to load from ``tier`` (None: every tier together); None
        while unknown.  A tier with too few samples of its own takes the global rate."""
        if tier is not None and self.tier_samples.get(tier, 0) >= self.MIN_SAMPLES:
            return self.tier_cost[tier]
        if self._load_samples >= self.MIN_SAMPLES and self.load_rate:
            return 1.0 / self.load_rate
        return None

    def plan(self, pieces: Sequence[tuple[str | None, int]]) -> int:
        """Tokens worth loading of a load made of ``pieces`` ((tier, tokens) in order):
        the sum of the leading run of pieces that saves the most time (the longest
        of equals).  Everything while the prefill rate is unknown."""
        total = sum(n for _, n in pieces)
        if self._prefill_samples < self.MIN_SAMPLES or not self.prefill_rate:
            return total
        compute = self.margin / self.prefill_rate
        saved = best_saved = 0.0
        tokens = best = 0
        for tier, n in pieces:
            cost = self.cost(tier)
            saved += n * (compute - (compute if cost is None else cost))
            tokens += n
            if saved >= best_saved:
                best_saved, best = saved, tokens
        return best

    def pays(self, tokens: int) -> bool:
        """Whether loading ``tokens`` tokens (tier unknown) is expected to beat computing them."""
        if tokens <= 0 or not self.ready:
            return True
        return self.plan([(None, tokens)]) == tokens

    def describe(self) -> dict[str, float]:
        """The rates learned so far (tokens per second), for logs."""
        out = {f"load_{tier}": 1.0 / c for tier, c in self.tier_cost.items() if c > 0}
        if self.load_rate:
            out["load"] = self.load_rate
        if self.prefill_rate:
            out["prefill"] = self.prefill_rate
        return out
