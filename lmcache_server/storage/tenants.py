"""Tenants and their byte quotas, shared by the memory and disk tiers.

A chunk belongs to a tenant when its namespace's last ``|`` field is
``tenant=<name>`` (what ``Namespace(tenant=...).wire()`` writes, and what the
security grants match, see security/access.py).  ``tenant_quotas`` in the
config caps the bytes each named tenant may hold per tier; a store that would
go over its tenant's quota first evicts that tenant's own chunks, in the
tier's policy order, and answers NO_SPACE when only leased or pinned ones are
left.  Chunks of other tenants, and of namespaces without a tenant, are never
evicted for it.

In the memory tier every byte charged is a byte held in the pool: a chunk's
*extent* (its payload rounded up to 4 KiB pages, ``extent_of``), so a tenant
cannot hold more of the pool than its quota by storing tiny chunks.  The
memory tier also counts each tenant's pinned extents here (``account_pinned``)
to bound them by the tenant's share of the pinnable room (storage/memory/index.py).

Primitives: :func:`tenant_of`, :class:`TenantQuotas` (``limit_for``, ``used``,
``account``, ``reserved``, ``account_reserved``, ``pinned``, ``account_pinned``,
``stats``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TENANT_FIELD = "tenant="


def tenant_of(namespace: str) -> str | None:
    """The tenant a namespace belongs to, or None."""
    last = namespace.rpartition("|")[2]
    if last.startswith(TENANT_FIELD) and len(last) > len(TENANT_FIELD):
        return last[len(TENANT_FIELD) :]
    return None


class TenantQuotas:
    """Byte limits per tenant for one tier, and the bytes each tenant holds (and,
    in memory, pins) there."""

    def __init__(self, limits: Mapping[str, int] | None = None):
        self.limits = dict(limits or {})
        self._used: dict[str, int] = {}
        self._pinned: dict[str, int] = {}
        self._reserved: dict[str, int] = {}
        self.evictions: dict[str, int] = {t: 0 for t in self.limits}

    def __bool__(self) -> bool:
        return bool(self.limits)

    def limit_for(self, namespace: str) -> tuple[str, int] | None:
        """(tenant, its limit) when the namespace's tenant has a quota here."""
        if not self.limits:
            return None
        tenant = tenant_of(namespace)
        if tenant is None or tenant not in self.limits:
            return None
        return tenant, self.limits[tenant]

    def used(self, tenant: str) -> int:
        return self._used.get(tenant, 0)

    def reserved(self, tenant: str) -> int:
        """Bytes of ``tenant``'s chunks being written (memory tier: room reserved, not yet committed)."""
        return self._reserved.get(tenant, 0)

    def account_reserved(self, namespace: str, nbytes: int) -> None:
        """Add (a reservation) or, negative, remove (its commit or abort) bytes of a chunk of ``namespace``."""
        _add(self._reserved, self._tenant(namespace), nbytes)

    def pinned(self, tenant: str) -> int:
        """Bytes of ``tenant``'s pinned chunks (memory tier: their extents)."""
        return self._pinned.get(tenant, 0)

    def account(self, namespace: str, nbytes: int) -> None:
        """Add (or, negative, remove) bytes of a chunk of ``namespace``."""
        _add(self._used, self._tenant(namespace), nbytes)

    def account_pinned(self, namespace: str, nbytes: int) -> None:
        """Add (a pin) or, negative, remove (its end) bytes of a pinned chunk of ``namespace``."""
        _add(self._pinned, self._tenant(namespace), nbytes)

    def _tenant(self, namespace: str) -> str | None:
        """The namespace's tenant when it has a quota here, else None (nothing to count)."""
        if not self.limits:
            return None
        tenant = tenant_of(namespace)
        return tenant if tenant is not None and tenant in self.limits else None

    def stats(self) -> dict[str, Any]:
        return {
            t: {"limit_bytes": limit, "used_bytes": self.used(t), "quota_evictions": self.evictions.get(t, 0)}
            for t, limit in self.limits.items()
        }


def _add(counts: dict[str, int], tenant: str | None, nbytes: int) -> None:
    if tenant is not None:
        counts[tenant] = counts.get(tenant, 0) + nbytes
