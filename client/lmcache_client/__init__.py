"""lmcache-client: the thin client of lmcache-server.

- :class:`CacheClient` (blocking) and :class:`AsyncCacheClient` (asyncio)
- :class:`Namespace` and :func:`chunk_keys` / :class:`ChunkHasher` (canonical keys)
- :mod:`lmcache_client.protocol`: the wire protocol, defined here once
"""

from .aio import AsyncCacheClient
from .calls import LookupResult
from .client import DEFAULT_ADDRESS, CacheClient
from .errors import BadAddress, ClientError, DaemonUnavailable, ServerError
from .keys import ChunkHasher, chain_key, chunk_keys
from .namespace import Namespace
from .protocol import ErrorCode, PutStatus

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_ADDRESS",
    "AsyncCacheClient",
    "BadAddress",
    "CacheClient",
    "ChunkHasher",
    "ClientError",
    "DaemonUnavailable",
    "ErrorCode",
    "LookupResult",
    "Namespace",
    "PutStatus",
    "ServerError",
    "chain_key",
    "chunk_keys",
]
