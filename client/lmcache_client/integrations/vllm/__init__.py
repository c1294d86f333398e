"""The vLLM V1 KV connector: lmcache-server as vLLM's prefix KV cache.

- ``connector``: :class:`LMCacheServerConnectorV1`, the class vLLM loads
  (``kv_connector_module_path: lmcache_client.integrations.vllm.connector``),
  a thin shim over the two sides;
- ``settings``: :class:`ConnectorSettings`, ``kv_connector_extra_config`` validated;
- ``scheduler/``: the scheduler process's side (what to load and store, per
  step), a room of its own: its lookups, cost gate and KV events live there;
- ``worker/``: the worker process's side, a room of its own (chunks in and out
  of the paged KV cache through one copy mechanism, its asynchronous loads and
  saves, layer-wise saves, Mamba states);
- ``plumbing`` and ``vllmconfig``: the connector's clients and lanes, and what it
  reads from vLLM's config;
- ``lanes``: the threads that talk to the daemon off vLLM's threads;
- ``layout``: the KV cache layout of a running vLLM, read from vLLM itself;
- ``meta``: what the scheduler side tells its workers once per step;
- ``stats``: the connector's counters in vLLM's own;
- ``compat``: what the connector takes from vLLM (imported there and only
  there), with stand-ins when vLLM is absent.

It builds on the shared pieces one floor down (``..transfer``, ``..paged``,
``..chunklayout``, ``..coded``).  Importing this package imports neither vLLM nor
torch: the names below load :mod:`.connector` on first use.

Primitives: :class:`LMCacheServerConnectorV1`, :class:`ConnectorSettings`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .connector import LMCacheServerConnectorV1
    from .settings import ConnectorSettings

__all__ = ["ConnectorSettings", "LMCacheServerConnectorV1"]


def __getattr__(name: str) -> Any:
    """The connector's names on first use (the connector imports vLLM where it is installed)."""
    if name == "ConnectorSettings":
        from . import settings

        return settings.ConnectorSettings
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
