"""Deprecated alias kept for configs written before the move; the module is
``lmcache_client.integrations.sglang.hicache``.

SGLang's dynamic storage backend config names a ``module_path`` and a
``class_name`` in it, so configs that still say
``lmcache_client.integrations.sglang_hicache`` keep loading the same class.

Primitives: :class:`LMCacheServerHiCacheStorage` (re-exported).
"""

from .sglang.hicache import LMCacheServerHiCacheStorage

__all__ = ["LMCacheServerHiCacheStorage"]
