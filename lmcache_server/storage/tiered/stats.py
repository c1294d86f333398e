"""The tiered store's figures: per tier (with promotions and the gates' counters),
the lookups' hit rate, the KV events', and per namespace.

Redis keeps no per-namespace index (a count would be a SCAN of a shared server):
its namespace figures are left out rather than shown as 0.

Primitives: :class:`StoreStats` (``stats``).
"""

from __future__ import annotations

from typing import Any

from ..base import Residency
from .gate import StoreGate
from .lookups import LookupCounters
from .roles import Tiers


class StoreStats:
    """``promotions``: promotions per lower tier's name (the promotion part's counts)."""

    def __init__(
        self,
        tiers: Tiers,
        lookups: LookupCounters,
        promotions: dict[str, int],
        gate: StoreGate | None,
        events: Residency | None,
    ):
        self._tiers = tiers
        self._lookups = lookups
        self._promotions = promotions
        self._gate = gate
        self._events = events

    def stats(self, namespace: str | None = None) -> dict[str, Any]:
        c = self._lookups
        tiers = {t.name: t.stats() for t in self._tiers.all}
        for name, count in self._promotions.items():
            tiers[name]["promotions"] = count
        if self._gate is not None:
            for name, counts in self._gate.stats().items():
                if name in tiers:
                    tiers[name].update(counts)
        out: dict[str, Any] = {
            "tiers": tiers,
            "lookups": c.lookups,
            "lookup_chunks": c.chunks_asked,
            "lookup_hit_chunks": c.chunks_hit,
            "lookup_hit_rate": round(c.chunks_hit / c.chunks_asked, 4) if c.chunks_asked else 0.0,
        }
        if self._events is not None:
            out["events"] = self._events.stats()
        per_tier = {t.name: t.namespaces() for t in self._tiers.all if t is not self._tiers.remote}
        if namespace is not None:
            out["namespace"] = {"name": namespace, **self._namespace_stats(per_tier, namespace)}
        else:
            names = sorted({ns for counts in per_tier.values() for ns in counts})
            out["namespaces"] = {ns: self._namespace_stats(per_tier, ns) for ns in names}
        return out

    def _namespace_stats(self, per_tier: dict[str, dict[str, tuple[int, int]]], namespace: str) -> dict[str, Any]:
        """One namespace's chunks and bytes per tier, and its pinned chunks and bytes."""
        out = _namespace_stats(per_tier, namespace)
        out["pinned_chunks"], out["pinned_bytes"] = self._tiers.memory.pinned_in(namespace)
        return out


def _namespace_stats(per_tier: dict[str, dict[str, tuple[int, int]]], namespace: str) -> dict[str, Any]:
    memory_chunks, memory_bytes = per_tier.get("memory", {}).get(namespace, (0, 0))
    out: dict[str, Any] = {"chunks": memory_chunks, "stored_bytes": memory_bytes}
    for tier, counts in per_tier.items():
        if tier != "memory":
            chunks, nbytes = counts.get(namespace, (0, 0))
            out[f"{tier}_chunks"] = chunks
            out[f"{tier}_stored_bytes"] = nbytes
    return out
