"""The scheduler process's side of the vLLM connector: what to load and store, per step.

- ``side``: :class:`SchedulerSide`, the front the connector holds; it builds
  its parts and delegates to them:
- ``matcher``: how much the daemon holds of a waiting request
  (:func:`key_root`: the key chain root of a request's KV), on
- ``lookups``: asynchronous lookups, one lane per rank;
- ``emitter``: a request's load and saves in a step's metadata, announced as
  KV events by ``events`` (:class:`ConnectorEvents`);
- ``statescheduling``: a Mamba hybrid's state hits, loads and saves;
- ``loadcosts`` on ``costgate``: loads slower than computing them are cut;
- ``sources``: where each admitted request's prompt tokens came from;
- ``perrequest``: the per-request record the parts share; ``tracker``: the
  record of one scheduled request.

What both processes share (``meta``, ``params``, ``groups``, ``states``,
``lanes``, ``compat``) lives one floor up, in :mod:`..`.

Primitives: :class:`SchedulerSide`, :func:`key_root`, :class:`CostGate`,
:class:`LookupService`, :class:`ConnectorEvents`.
"""

from __future__ import annotations

from .costgate import CostGate
from .events import ConnectorEvents
from .lookups import LookupService
from .matcher import key_root
from .side import SchedulerSide

__all__ = ["ConnectorEvents", "CostGate", "LookupService", "SchedulerSide", "key_root"]
