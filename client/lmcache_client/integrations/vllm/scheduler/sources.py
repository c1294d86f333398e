"""Where each request's prompt tokens came from (:class:`PromptSources`).

At admission (``update_state_after_alloc``) a request's prompt splits into:

- ``vllm_cache``: tokens vLLM's own prefix cache held (the ``num_computed_tokens``
  of the last ``get_num_new_matched_tokens`` before the request was admitted);
- one source per daemon tier the load reads, named as the daemon's lookup names
  it (``memory``, ``disk``, ``redis``): the tokens vLLM loads from the daemon
  (``daemon``: loaded tokens whose tier the lookup did not name);
- ``recomputed``: the rest, which the engine computes.

The parts sum exactly to the prompt length.  Each request counts once, at its
first admission: an asynchronous load resumes it through the same call with no
external tokens, and a preempted request is admitted again; neither counts
again (vLLM's own ``vllm:prompt_tokens_by_source`` counts the first schedule
too).  A load that fails later is recomputed by vLLM: it stays counted under its
tier here and shows in ``load_failed_tokens``.

The counts reach vLLM's connector stats as ``prompt_tokens_<source>`` and
Prometheus as ``vllm:lmcache_server_prompt_tokens_total{source="..."}``
(:mod:`..stats`); one request's split is returned with its outputs as
``kv_transfer_params["lmcache_prompt_sources"]`` (:meth:`PromptSources.take`).

Primitive: :class:`PromptSources`.
"""

from __future__ import annotations

from typing import Any

RECOMPUTED = "recomputed"
VLLM_CACHE = "vllm_cache"
UNNAMED = "daemon"
"""Loaded tokens whose tier the lookup did not name."""
STAT_PREFIX = "prompt_tokens_"
"""A stats counter ``prompt_tokens_<source>`` is the Prometheus counter's ``source`` label."""
SOURCES = (RECOMPUTED, VLLM_CACHE, "memory", "disk", "redis")
"""The sources counted from the start (zero until used); another daemon tier adds its name."""


class PromptSources:
    """A part of :class:`~.side.SchedulerSide`: each request's prompt split by source.

    ``stats`` is the scheduler side's counter dict (zeroed in place by ``take_stats``)."""

    def __init__(self, stats: dict[str, float]):
        self._stats = stats
        for source in SOURCES:
            stats.setdefault(STAT_PREFIX + source, 0)
        self._local: dict[str, int] = {}
        """vLLM's own hit of each waiting request, as last asked."""
        self._split: dict[str, dict[str, int]] = {}
        """Each admitted request's split, until it finishes."""

    def asked(self, req_id: str, num_computed_tokens: int) -> None:
        """``get_num_new_matched_tokens``: vLLM's own prefix cache holds ``num_computed_tokens``."""
        if req_id not in self._split:
            self._local[req_id] = max(0, int(num_computed_tokens))

    def admitted(self, request: Any, num_external_tokens: int, by_tier: dict[str, int]) -> None:
        """``update_state_after_alloc``: the request is admitted, ``by_tier`` (tokens per daemon
        tier, summing to ``num_external_tokens``) to be loaded.  Counted once per request."""
        req_id = request.request_id
        if req_id in self._split or int(getattr(request, "num_preemptions", 0) or 0) > 0:
            return
        prompt = int(getattr(request, "num_prompt_tokens", 0) or len(request.prompt_token_ids or ()))
        local = min(self._local.pop(req_id, 0), prompt)
        external = {tier: n for tier, n in by_tier.items() if n > 0}
        unnamed = max(0, num_external_tokens) - sum(external.values())
        if unnamed < 0:  # pragma: no cover - the tiers cover more than the load: trust the load
            external, unnamed = {}, num_external_tokens
        if unnamed > 0:  # a load whose tiers the lookup did not name
            external[UNNAMED] = unnamed
        split = {VLLM_CACHE: local, **external}
        split[RECOMPUTED] = max(0, prompt - sum(split.values()))
        self._split[req_id] = split
        for source, n in split.items():
            key = STAT_PREFIX + source
            self._stats[key] = self._stats.get(key, 0) + n

    def take(self, req_id: str) -> dict[str, int] | None:
        """The request's split (None: never admitted), forgotten."""
        self._local.pop(req_id, None)
        return self._split.pop(req_id, None)
