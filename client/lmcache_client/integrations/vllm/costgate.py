"""CostGate (the cost gate) moved to :mod:`.scheduler.costgate` (issue 40).

This name stays only until the connector and its wiring import it from
:mod:`.scheduler`; then it goes.

Primitive: :class:`CostGate`.
"""

from __future__ import annotations

from .scheduler.costgate import CostGate

__all__ = ["CostGate"]
