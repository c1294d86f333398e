"""The cost gate's side of the scheduler (:mod:`.costgate`): what each load would cost,
and which loads the workers' stats of a step cover.

``cut`` asks the gate how much of a hit to load, chunk by chunk with the tier
the lookup named; ``allocated`` remembers the tier mix of each load vLLM
allocated; the loads a step's worker stats cover (those the workers report
finished, or, synchronously, the loads of the step's metadata) become the
gate's load-rate sample in ``saw_output``.

Primitive: :class:`LoadCosts`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .costgate import CostGate
from .perrequest import PerRequest


class LoadCosts:
    """A part of :class:`~.side.SchedulerSide`, built when ``cost_gate`` is set."""

    def __init__(self, gate: CostGate, chunk_size: int, book: PerRequest, stats: dict[str, float]):
        self.gate = gate
        self._chunk_size = chunk_size
        self._book = book
        """Reads each request's hit (its chunks' tiers)."""
        self._stats = stats
        self.load_mix: dict[str, dict[str, int]] = {}
        """The tokens of each request's load by the tier its lookup named."""
        self.measured: list[str] = []
        """Requests whose loads the next workers' stats cover."""

    def cut(self, req_id: str, n: int) -> int:
        """How many of the ``n`` tokens of the request's hit are worth loading (counted when fewer)."""
        keep = self.gate.plan(self._pieces(req_id, n))
        if keep < n:
            self._stats["loads_skipped_by_cost" if keep == 0 else "loads_cut_by_cost"] += 1
            self._stats["load_tokens_skipped_by_cost"] += n - keep
            return keep
        return n

    def _pieces(self, req_id: str, n: int) -> list[tuple[str | None, int]]:
        """The load of ``n`` tokens as (tier, tokens) per chunk, in order (the gate's input)."""
        hit = self._book.hits.get(req_id)
        if hit is None or not hit.tiers:
            return [(None, n)]
        start, end = hit.local_tokens, hit.local_tokens + n
        pieces: list[tuple[str | None, int]] = []
        for i, tier in enumerate(hit.tiers):
            lo, hi = max(start, i * self._chunk_size), min(end, (i + 1) * self._chunk_size)
            if hi > lo:
                pieces.append((tier, hi - lo))
        return pieces

    def allocated(self, req_id: str, sources: dict[str, int]) -> None:
        """vLLM allocated the request's load: its tokens by tier (``hit_sources``)."""
        self.load_mix[req_id] = sources

    def loaded(self, req_ids: Iterable[str]) -> None:
        """The workers report these asynchronous loads done: the next stats cover them."""
        self.measured.extend(req_ids)

    def loaded_in_step(self, req_ids: Iterable[str]) -> None:
        """Synchronous loads: the step's stats cover the loads of its metadata."""
        self.measured = list(req_ids)

    def step_began(self, scheduled_tokens: int) -> None:
        """A step was scheduled with ``scheduled_tokens`` tokens (the prefill rate)."""
        self.gate.saw_step(scheduled_tokens)

    def saw_output(self, stats: Any) -> None:
        """The workers' stats of a step (``update_connector_output``): a load-rate sample."""
        data = getattr(stats, "data", None)
        measured, self.measured = self.measured, []
        mix: dict[str, float] = {}
        for req_id in measured:
            for tier, n in self.load_mix.pop(req_id, {}).items():
                mix[tier] = mix.get(tier, 0) + n
        if isinstance(data, dict):
            self.gate.saw_load(float(data.get("loaded_tokens", 0)), float(data.get("load_s", 0.0)), mix)

    def forget(self, req_id: str) -> None:
        """The request ended: its mix goes, unless the step's stats, read after vLLM frees it, use it."""
        if req_id not in self.measured:
            self.load_mix.pop(req_id, None)
