"""Scheduler side of the vLLM connector: what to load and what to store, per step.

vLLM calls, for a waiting request:

1. ``get_num_new_matched_tokens(request, num_computed_tokens)``: the daemon is
   asked how many leading chunks of the prompt it holds (never the chunk with
   the last prompt token, so at least one token is computed and the request
   gets logits); under tensor parallelism every rank's namespace is asked and
   the smallest answer counts.  The answer is the hit beyond vLLM's own
   prefix cache (``num_computed_tokens``, block aligned).  Calls have no
   effect beyond remembering the latest answer, so vLLM may repeat them.
2. ``update_state_after_alloc(request, blocks, num_external_tokens)``: vLLM
   allocated blocks for ``num_external_tokens`` tokens; they become a load.
3. ``build_connector_meta(scheduler_output)``: loads of newly scheduled
   requests, and a save of every full prompt chunk that becomes computed in
   this step (a request tracker follows each request's blocks across chunked
   prefill and preemption).
4. ``request_finished``: the tracker goes; saves happen at the end of the
   step that computed them, so blocks are never held past the request.

Requests whose KV depends on more than their tokens get keys of their own:
a LoRA adapter's name and a ``cache_salt`` are folded into the key chain's
root (:func:`~lmcache_client.keys.salted_root`).  Multimodal requests and
prompt embeddings are neither loaded nor stored (their placeholder tokens do
not name their KV).  ``kv_role``: ``kv_producer`` never loads,
``kv_consumer`` never stores.

Primitive: :class:`SchedulerSide`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

from ..keys import chunk_keys, salted_root
from .transfer import ChunkTransfer
from .vllm_compat import first_group, resumed
from .vllm_meta import LMCacheServerConnectorMetadata, LoadRequest, SaveRequest

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Hit:
    local_tokens: int
    """Tokens vLLM had computed (its own prefix cache) when asked."""
    hit_chunks: int
    tiers: list[str] = dataclasses.field(default_factory=list)
    """The daemon tier of each hit chunk (the first rank's)."""


@dataclasses.dataclass
class _Tracker:
    keys: list[bytes]
    """Keys of every full chunk of the prompt."""
    prompt_len: int
    block_ids: list[int]
    stored_chunks: int
    """Leading chunks the daemon holds already (found by lookup or saved)."""


def key_root(request: Any) -> bytes | None:
    """The key chain root of ``request``'s KV; None when its KV cannot be named by
    its tokens (multimodal inputs, prompt embeddings)."""
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        return None
    parts: list[str] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append("lora=" + str(getattr(lora, "lora_name", None) or getattr(lora, "name", "")))
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append("salt=" + str(salt))
    return salted_root(*parts)


class SchedulerSide:
    """Per-request bookkeeping of the scheduler process (single-threaded, as vLLM's scheduler).

    ``transfers`` has one entry per tensor-parallel rank (the rank's namespace);
    saves and loads are the workers' business, the scheduler only looks up."""

    def __init__(self, transfers: Sequence[ChunkTransfer], chunk_size: int, *, load: bool = True, save: bool = True):
        self.transfers = list(transfers)
        self.chunk_size = chunk_size
        self.load_enabled = load
        self.save_enabled = save
        self._hits: dict[str, _Hit] = {}
        self._roots: dict[str, bytes | None] = {}
        self._loads: dict[str, tuple[int, int]] = {}
        self._trackers: dict[str, _Tracker] = {}
        self.stats = {"lookups": 0, "lookup_hit_tokens": 0, "lookup_s": 0.0}

    @property
    def transfer(self) -> ChunkTransfer:
        return self.transfers[0]

    def take_stats(self) -> dict[str, float]:
        data = dict(self.stats)
        self.stats = {name: 0 for name in self.stats}
        return data

    # -- get_num_new_matched_tokens -------------------------------------------------
    def lookup(self, keys: list[bytes]) -> list[str]:
        """The tiers of the leading chunks every rank's namespace holds (the first rank's tiers)."""
        tiers = self.transfers[0].lookup_tiers(keys)
        for transfer in self.transfers[1:]:
            if not tiers:
                break
            tiers = tiers[: transfer.lookup(keys[: len(tiers)])]
        return tiers

    def hit_sources(self, req_id: str, num_external_tokens: int) -> dict[str, int]:
        """Tokens of the request's load per daemon tier (of the chunks it covers)."""
        hit = self._hits.get(req_id)
        if hit is None or num_external_tokens <= 0:
            return {}
        sources: dict[str, int] = {}
        start, end = hit.local_tokens, hit.local_tokens + num_external_tokens
        for i, tier in enumerate(hit.tiers):
            lo, hi = max(start, i * self.chunk_size), min(end, (i + 1) * self.chunk_size)
            if hi > lo:
                sources[tier] = sources.get(tier, 0) + hi - lo
        return sources

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        req_id = request.request_id
        prompt = request.prompt_token_ids
        root = key_root(request)
        self._roots[req_id] = root
        if not prompt or root is None or not self.load_enabled:
            return 0
        reusable = (len(prompt) - 1) // self.chunk_size
        if reusable * self.chunk_size <= num_computed_tokens:
            return 0  # vLLM's own cache already holds every chunk the daemon could add
        started = time.perf_counter()
        tiers = self.lookup(chunk_keys(prompt[: reusable * self.chunk_size], self.chunk_size, root))
        self.stats["lookups"] += 1
        self.stats["lookup_s"] += time.perf_counter() - started
        self._hits[req_id] = _Hit(num_computed_tokens, len(tiers), tiers)
        return max(0, len(tiers) * self.chunk_size - num_computed_tokens)

    # -- update_state_after_alloc ---------------------------------------------------
    def after_alloc(self, req_id: str, num_external_tokens: int) -> None:
        hit = self._hits.get(req_id)
        if hit is not None and num_external_tokens > 0:
            self._loads[req_id] = (hit.local_tokens, hit.local_tokens + num_external_tokens)
            self.stats["lookup_hit_tokens"] += num_external_tokens

    # -- build_connector_meta -------------------------------------------------------
    def build_meta(self, scheduler_output: Any) -> LMCacheServerConnectorMetadata:
        meta = LMCacheServerConnectorMetadata()
        for req_id in scheduler_output.finished_req_ids:
            self.forget(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            root = self._roots.get(new.req_id, key_root(new))
            if root is None:
                continue
            prompt = list(new.prompt_token_ids or [])
            hit = self._hits.pop(new.req_id, None)
            tracker = _Tracker(
                chunk_keys(prompt, self.chunk_size, root),
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
        if not self.save_enabled:
            return
        ready = min(computed, tracker.prompt_len) // self.chunk_size
        if ready <= tracker.stored_chunks:
            return
        first = tracker.stored_chunks
        meta.saves.append(SaveRequest(req_id, tracker.keys[first:ready], first, list(tracker.block_ids)))
        tracker.stored_chunks = ready

    # -- request_finished -----------------------------------------------------------
    def forget(self, req_id: str) -> None:
        self._hits.pop(req_id, None)
        self._roots.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._trackers.pop(req_id, None)
