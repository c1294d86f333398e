"""Eviction policies: which chunk a tier gives up next, and which it refuses.

A tier owns the bytes; a policy only orders keys (the primitives are listed in
:mod:`.base`).  This room holds the policy interface and the classic policies
(``base``: :class:`EvictionPolicy`, :class:`LRUPolicy`, :class:`LFUDAPolicy`),
the adaptive admission built on lfuda (``adaptive``) and the compact frequency
history both keep of evicted keys (``history``).  It imports only the storage
leaves (``storage/base.py``).  Others use :func:`make_policy` and the names below.
"""

from .adaptive import AdaptivePolicy
from .base import POLICIES, EvictionPolicy, LFUDAPolicy, LRUPolicy, make_policy

__all__ = ["POLICIES", "AdaptivePolicy", "EvictionPolicy", "LFUDAPolicy", "LRUPolicy", "make_policy"]
