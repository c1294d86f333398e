"""Scheduler side of the vLLM connector: what to load and what to store, per step.

vLLM calls, for a waiting request:

1. ``get_num_new_matched_tokens(request, num_computed_tokens)``: the daemon is
   asked how many leading chunks of the prompt it holds (never the chunk with
   the last prompt token, so at least one token is computed and the request
   gets logits); the answer is the hit beyond vLLM's own prefix cache.  Calls
   have no effect beyond remembering the latest answer, so vLLM may repeat them.
2. ``update_state_after_alloc(request, blocks, num_external_tokens)``: vLLM
   allocated blocks for ``num_external_tokens`` tokens; they become a load.
3. ``build_connector_meta(scheduler_output)``: loads of newly scheduled
   requests, and a save of every full prompt chunk that becomes computed in
   this step (a request tracker follows each request's blocks across chunked
   prefill and preemption).
4. ``request_finished``: the tracker goes; saves happen during the forward
   pass (worker side), so blocks are never held past the request.

Primitive: :class:`SchedulerSide`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ..keys import chunk_keys
from .transfer import ChunkTransfer
from .vllm_compat import first_group, resumed
from .vllm_meta import LMCacheServerConnectorMetadata, LoadRequest, SaveRequest

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Hit:
    local_tokens: int
    """Tokens vLLM had computed (its own prefix cache) when asked."""
    hit_chunks: int


@dataclasses.dataclass
class _Tracker:
    keys: list[bytes]
    """Keys of every full chunk of the prompt."""
    prompt_len: int
    block_ids: list[int]
    stored_chunks: int
    """Leading chunks the daemon holds already (found by lookup or saved)."""


class SchedulerSide:
    """Per-request bookkeeping of the scheduler process (single-threaded, as vLLM's scheduler)."""

    def __init__(self, transfer: ChunkTransfer, chunk_size: int):
        self.transfer = transfer
        self.chunk_size = chunk_size
        self._hits: dict[str, _Hit] = {}
        self._loads: dict[str, tuple[int, int]] = {}
        self._trackers: dict[str, _Tracker] = {}

    # -- get_num_new_matched_tokens -------------------------------------------------
    def num_new_matched_tokens(self, req_id: str, prompt: list[int] | None, num_computed_tokens: int) -> int:
        if not prompt:
            return 0
        reusable = (len(prompt) - 1) // self.chunk_size
        hit_chunks = self.transfer.lookup(chunk_keys(prompt[: reusable * self.chunk_size], self.chunk_size))
        self._hits[req_id] = _Hit(num_computed_tokens, hit_chunks)
        return max(0, hit_chunks * self.chunk_size - num_computed_tokens)

    # -- update_state_after_alloc ---------------------------------------------------
    def after_alloc(self, req_id: str, num_external_tokens: int) -> None:
        hit = self._hits.get(req_id)
        if hit is not None and num_external_tokens > 0:
            self._loads[req_id] = (hit.local_tokens, hit.local_tokens + num_external_tokens)

    # -- build_connector_meta -------------------------------------------------------
    def build_meta(self, scheduler_output: Any) -> LMCacheServerConnectorMetadata:
        meta = LMCacheServerConnectorMetadata()
        for req_id in scheduler_output.finished_req_ids:
            self.forget(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or [])
            hit = self._hits.pop(new.req_id, None)
            tracker = _Tracker(
                chunk_keys(prompt, self.chunk_size),
                len(prompt),
                first_group(new.block_ids),
                hit.hit_chunks if hit else 0,
            )
            self._trackers[new.req_id] = tracker
            self._emit_load(meta, new.req_id, tracker)
            computed = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            self._emit_save(meta, new.req_id, tracker, computed)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            running = self._trackers.get(req_id)
            if running is None:
                continue
            tracker = running
            new_blocks = first_group(cached.new_block_ids[i]) if cached.new_block_ids[i] is not None else []
            if resumed(cached, i, req_id):
                tracker.block_ids = new_blocks
                hit = self._hits.pop(req_id, None)
                if hit is not None:
                    tracker.stored_chunks = max(tracker.stored_chunks, hit.hit_chunks)
            else:
                tracker.block_ids.extend(new_blocks)
            self._emit_load(meta, req_id, tracker)
            computed = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self._emit_save(meta, req_id, tracker, computed)
        return meta

    def _emit_load(self, meta: LMCacheServerConnectorMetadata, req_id: str, tracker: _Tracker) -> None:
        span = self._loads.pop(req_id, None)
        if span is None:
            return
        start, end = span
        first = start // self.chunk_size
        last = -(-end // self.chunk_size)
        meta.loads.append(LoadRequest(req_id, tracker.keys[first:last], first, start, end, list(tracker.block_ids)))
        tracker.stored_chunks = max(tracker.stored_chunks, last)

    def _emit_save(self, meta: LMCacheServerConnectorMetadata, req_id: str, tracker: _Tracker, computed: int) -> None:
        ready = min(computed, tracker.prompt_len) // self.chunk_size
        if ready <= tracker.stored_chunks:
            return
        first = tracker.stored_chunks
        meta.saves.append(SaveRequest(req_id, tracker.keys[first:ready], first, list(tracker.block_ids)))
        tracker.stored_chunks = ready

    # -- request_finished -----------------------------------------------------------
    def forget(self, req_id: str) -> None:
        self._hits.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._trackers.pop(req_id, None)
