"""What a vLLM worker connector moved: :class:`WorkerStats` (vLLM's per-step connector
stats, :mod:`.stats`) and :class:`LoadResult` (one load's outcome)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class WorkerStats:
    """What this worker moved since the stats were last taken."""

    loaded_tokens: int = 0
    load_failed_tokens: int = 0
    loaded_bytes: int = 0
    load_s: float = 0.0
    stored_chunks: int = 0
    stored_bytes: int = 0
    store_s: float = 0.0
    load_deadline_missed: int = 0
    saves_dropped: int = 0
    """Saves not made because too many were queued (asynchronous mode: a slow daemon)."""
    stored_states: int = 0
    """Mamba states stored (:mod:`.states`)."""
    layerwise_saves: int = 0
    """Saves stored from layer-wise copies (``layerwise_save``; :mod:`.layerwise`)."""
    layerwise_fallbacks: int = 0
    """Saves gathered from the cache after all under ``layerwise_save`` (staging full,
    a layer never reported, a failed copy)."""

    def take(self) -> dict[str, float]:
        """The counters since the last take (vLLM's per-step stats); they restart at zero."""
        data = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.default)
        return data

    def add_to(self, totals: dict[str, float]) -> None:
        for name, value in dataclasses.asdict(self).items():
            totals[name] = totals.get(name, 0) + value


@dataclasses.dataclass
class LoadResult:
    """What one load did: tokens up to ``end`` are in the KV cache."""

    end: int
    nbytes: int = 0
    seconds: float = 0.0
    late: bool = False
    """The deadline passed before every chunk arrived; the rest is recomputed."""
