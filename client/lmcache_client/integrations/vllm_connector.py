"""Deprecated alias kept for configs written before the move; the module is
``lmcache_client.integrations.vllm.connector``.

vLLM's ``kv_connector_module_path`` names a module and ``kv_connector`` a
class in it (``importlib.import_module`` then ``getattr``), so engine configs
that still say ``lmcache_client.integrations.vllm_connector`` keep loading
the same class.

Primitives: :class:`LMCacheServerConnectorV1` (re-exported).
"""

from .vllm.connector import LMCacheServerConnectorV1

__all__ = ["LMCacheServerConnectorV1"]
