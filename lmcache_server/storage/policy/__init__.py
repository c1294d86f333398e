"""Eviction policies: which chunk a tier gives up next, and which it refuses.

A tier owns the bytes; a policy only orders keys (the primitives are listed in
:mod:`.base`).  This room holds the policy interface and the classic policies
(``base``: :class:`EvictionPolicy`; ``lru``: :class:`LRUPolicy`; ``lfuda``: :class:`LFUDAPolicy`),
the adaptive admission built on lfuda (``adaptive``), the compact frequency
history both keep of evicted keys (``history``), the count-min sketch of accesses
the tier gate's ``frequency`` mode reads (``sketch``), and here the factory that
picks one by its ``cache_policy`` name (:func:`make_policy`, :data:`POLICIES`).
It imports only the storage leaves (``storage/base.py``).  Others use the
names below.
"""

from __future__ import annotations

from collections.abc import Callable

from .adaptive import AdaptivePolicy
from .base import EvictionPolicy
from .history import KeyHistory, key_hash
from .lfuda import LFUDAPolicy
from .lru import LRUPolicy
from .sketch import FrequencySketch

__all__ = [
    "POLICIES",
    "AdaptivePolicy",
    "EvictionPolicy",
    "FrequencySketch",
    "KeyHistory",
    "LFUDAPolicy",
    "LRUPolicy",
    "PolicyFactory",
    "key_hash",
    "make_policy",
]

PolicyFactory = Callable[[int | None, int], EvictionPolicy]
"""``(capacity_bytes, alignment) -> policy``: what a tier of that size needs."""


def _adaptive(capacity_bytes: int | None, alignment: int) -> EvictionPolicy:
    if capacity_bytes is None:  # a tier that sees spills, not puts: nothing to admit or refuse
        return LFUDAPolicy()
    return AdaptivePolicy(capacity_bytes, alignment)


POLICIES: dict[str, PolicyFactory] = {
    "lru": lambda capacity_bytes, alignment: LRUPolicy(),
    "lfuda": lambda capacity_bytes, alignment: LFUDAPolicy(),
    "adaptive": _adaptive,
}


def make_policy(name: str, capacity_bytes: int | None = None, alignment: int = 1) -> EvictionPolicy:
    """The policy called ``name`` for a tier of ``capacity_bytes`` that allocates
    in multiples of ``alignment`` bytes.

    ``adaptive`` needs the capacity (its experts model the tier).  Without it,
    as for the disk tier, which sees spills and never a put, it is ``lfuda``."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown cache_policy {name!r}; known: {sorted(POLICIES)}") from None
    return factory(capacity_bytes, alignment)
