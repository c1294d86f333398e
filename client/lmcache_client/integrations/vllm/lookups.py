"""LookupService (the scheduler's asynchronous lookups) moved to :mod:`.scheduler.lookups` (issue 40).

This name stays only until the connector and its wiring import it from
:mod:`.scheduler`; then it goes.

Primitive: :class:`LookupService`.
"""

from __future__ import annotations

from .scheduler.lookups import LookupService

__all__ = ["LookupService"]
