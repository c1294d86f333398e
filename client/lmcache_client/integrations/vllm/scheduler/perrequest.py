"""What the scheduler side keeps per request, shared by its parts (:class:`PerRequest`).

One record, built once by :class:`~.side.SchedulerSide` and passed into each
part's constructor: the matcher (:mod:`.matcher`) writes a request's
parameters, key root and hit; the front (:mod:`.side`) turns the hit into a
load span and a tracker; the emitter (:mod:`.emitter`) and the state
scheduling (:mod:`.statescheduling`) read them to build a step's metadata.
``forget`` drops a request from every dict at once, so no part keeps one
that vLLM has freed.

Primitives: :class:`PerRequest`, :class:`Hit`, :class:`Wait`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..params import RequestParams
from .tracker import Tracker


@dataclasses.dataclass
class Hit:
    """What the daemon holds of a waiting request's prompt, as the last lookup found it."""

    local_tokens: int
    """Tokens vLLM had computed (its own prefix cache) when asked."""
    hit_chunks: int
    """Leading chunks the daemon holds, the tail counting as the chunk after the full ones."""
    tiers: list[str] = dataclasses.field(default_factory=list)
    """The daemon tier of each hit chunk (the first rank's)."""
    state_tokens: int = 0
    """A Mamba hybrid: the length of the stored state the hit ends with (:mod:`..states`)."""


@dataclasses.dataclass
class Wait:
    """A request waiting for a producer's chunks (``load_wait_s``)."""

    first: float
    """When the request was first found incomplete (monotonic seconds)."""
    last: float
    """When the daemon was last asked."""


StateLoad = tuple[bytes | None, list[int] | None, int]
"""A request's state load: (key, blocks, tokens); a None key or blocks fails it."""


@dataclasses.dataclass(frozen=True)
class PerRequest:
    """The per-request dicts the scheduler side's parts share (single-threaded, as vLLM's scheduler).

    Frozen: the parts fill and empty the dicts, never replace them, so each part's
    reference stays the one the front built."""

    params: dict[str, RequestParams] = dataclasses.field(default_factory=dict)
    """Each request's ``kv_transfer_params``, validated and capped (:mod:`..params`)."""
    roots: dict[str, bytes | None] = dataclasses.field(default_factory=dict)
    """Each request's key chain root; None: its KV cannot be named by its tokens."""
    requests: dict[str, Any] = dataclasses.field(default_factory=dict)
    """vLLM's Request objects: their block hashes (KV events) and generated tokens (``save_decode_cache``)."""
    hits: dict[str, Hit] = dataclasses.field(default_factory=dict)
    waiting: dict[str, Wait] = dataclasses.field(default_factory=dict)
    loads: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    """The token span vLLM allocated for each request's load, until it is emitted."""
    state_loads: dict[str, StateLoad] = dataclasses.field(default_factory=dict)
    """Each request's state load (a Mamba hybrid), until it is emitted."""
    trackers: dict[str, Tracker] = dataclasses.field(default_factory=dict)
    """Each scheduled request's keys, blocks and what of it is stored."""
    saving: set[str] = dataclasses.field(default_factory=set)
    """Requests with asynchronous saves emitted (their blocks wait for them at the end)."""

    def forget(self, req_id: str) -> None:
        """Drop the request from every dict (``saving`` stays: ``request_finished`` reads it)."""
        self.params.pop(req_id, None)
        self.hits.pop(req_id, None)
        self.roots.pop(req_id, None)
        self.loads.pop(req_id, None)
        self.state_loads.pop(req_id, None)
        self.trackers.pop(req_id, None)
        self.waiting.pop(req_id, None)
        self.requests.pop(req_id, None)
