"""ConnectorEvents (the connector's KV events) moved to :mod:`.scheduler.events` (issue 40).

This name stays only until the connector and its wiring import it from
:mod:`.scheduler`; then it goes.

Primitive: :class:`ConnectorEvents`.
"""

from __future__ import annotations

from .scheduler.events import ConnectorEvents

__all__ = ["ConnectorEvents"]
