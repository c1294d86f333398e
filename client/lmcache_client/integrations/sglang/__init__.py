"""The SGLang HiCache storage backend: lmcache-server as SGLang's L3 KV tier.

- ``hicache``: :class:`LMCacheServerHiCacheStorage`, the class SGLang loads
  (``module_path: lmcache_client.integrations.sglang.hicache``), and
  :func:`page_key`, the daemon key of one SGLang page hash.

It builds on the shared pieces one floor down (``..transfer``, ``..chunklayout``).
Importing this package imports neither SGLang nor torch: the names below load
:mod:`.hicache` on first use.

Primitives: :class:`LMCacheServerHiCacheStorage`, :func:`page_key`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .hicache import LMCacheServerHiCacheStorage, page_key

__all__ = ["LMCacheServerHiCacheStorage", "page_key"]


def __getattr__(name: str) -> Any:
    """The backend's names on first use (the backend imports SGLang where it is installed)."""
    if name in __all__:
        from . import hicache

        return getattr(hicache, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
