"""Authentication, tenant access and exposure checks (docs/security.md).

- :mod:`.access`: client keys, tenant grants and roles; the per-request check.
- :mod:`.guard`: start-time checks (endpoints, key files) and the ZAP handler.
- :mod:`.querytokens`: who may ask ``POST /query`` (bearer tokens, per tenant).

Key files themselves are read and written by :mod:`lmcache_client.curve`,
shared with the clients.
"""

from .access import AccessPolicy, Grant, Principal, load_client_keys
from .guard import Security, is_loopback_endpoint
from .querytokens import QueryAccess, QueryScope

__all__ = [
    "AccessPolicy",
    "Grant",
    "Principal",
    "QueryAccess",
    "QueryScope",
    "Security",
    "is_loopback_endpoint",
    "load_client_keys",
]
