"""Scheduler side of the vLLM connector: what to load and what to store, per step.

vLLM calls, for a waiting request:

1. ``get_num_new_matched_tokens(request, num_computed_tokens)``: how many
   tokens the daemon can add (:class:`~.matching.Matcher`, this class's base);
   with asynchronous loads (the default) the request then waits in vLLM's
   ``WAITING_FOR_REMOTE_KVS`` while the workers load it.
2. ``update_state_after_alloc(request, blocks, num_external_tokens)``: vLLM
   allocated blocks for ``num_external_tokens`` tokens; they become a load,
   sent with the next metadata when asynchronous (``update_connector_output``
   tells when the workers are done), else with the request's first schedule.
3. ``build_connector_meta(scheduler_output)``: loads of newly scheduled
   requests, and a save of every full prompt chunk that becomes computed in
   this step (and of the tail, once the whole prompt is computed, where tails
   are stored: a ``kv_producer``, or ``store_tails``); a request tracker follows
   each request's blocks across chunked prefill and preemption.
4. ``request_finished``: the tracker goes.  Synchronous saves happen at the
   end of the step that computed them; asynchronous ones run after it, so a
   request with saves answers ``delay_free`` and its blocks are freed when the
   workers report its saves done (``meta.delayed``, ``finished_sending``).

Requests whose KV depends on more than their tokens get keys of their own:
a LoRA adapter's name and a ``cache_salt`` are folded into the key chain's
root (:func:`~lmcache_client.keys.salted_root`).  Multimodal requests and
prompt embeddings are neither loaded nor stored (their placeholder tokens do
not name their KV).  ``kv_role``: ``kv_producer`` never loads,
``kv_consumer`` never stores.

Primitive: :class:`SchedulerSide`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ...keys import ROOT_KEY
from ..transfer import ChunkTransfer
from .compat import resumed
from .costgate import CostGate
from .emits import Emitting
from .events import ConnectorEvents
from .groups import GroupInfo
from .lookups import LookupService
from .matching import Matcher, key_root
from .meta import LMCacheServerConnectorMetadata, LoadRequest
from .params import DEFAULT
from .statescheduler import StateScheduling
from .tracker import Tracker

logger = logging.getLogger(__name__)


class SchedulerSide(Emitting, StateScheduling, Matcher):
    """Per-request bookkeeping of the scheduler process (single-threaded, as vLLM's scheduler).

    ``transfers`` has one entry per tensor-parallel rank (the rank's namespace);
    saves and loads are the workers' business, the scheduler only looks up
    (:class:`~.matching.Matcher`) and tells them what to move."""

    def __init__(
        self,
        transfers: Sequence[ChunkTransfer],
        chunk_size: int,
        *,
        load: bool = True,
        save: bool = True,
        store_tails: bool = False,
        load_wait_s: float = 0.0,
        lookups: LookupService | None = None,
        async_load: bool = False,
        async_save: bool = False,
        save_decode_cache: bool = False,
        max_store_tokens: int = 0,
        load_deadline_ms: float = 0.0,
        cost_gate: CostGate | None = None,
    ):
        super().__init__(
            transfers,
            chunk_size,
            load=load,
            load_wait_s=load_wait_s,
            lookups=lookups,
            max_store_tokens=max_store_tokens,
            load_deadline_ms=load_deadline_ms,
        )
        self.save_decode_cache = save_decode_cache
        """Also store the full chunks of generated tokens (per request: ``lmcache_save_decode_cache``)."""
        self.cost_gate = cost_gate
        """Skips loads slower than computing them (:mod:`.costgate`); None: every load runs."""
        self.stats.update(loads_cut_by_cost=0, load_tokens_skipped_by_cost=0)
        self._load_mix: dict[str, dict[str, int]] = {}
        """The tokens of each request's load by the tier its lookup named (for the cost gate)."""
        self._measured: list[str] = []
        """Requests whose loads the next workers' stats cover (for the cost gate)."""
        self._deadlines: dict[str, float] = {}
        """Per-request load deadlines (seconds) for the next metadata."""
        self.save_enabled = save
        self.store_tails = store_tails
        self.async_load = async_load
        """Loads run while the request waits in WAITING_FOR_REMOTE_KVS (:mod:`.transfers`)."""
        self.async_save = async_save
        """Saves run after the step; a finished request's blocks wait for them."""
        self._async_loads: list[LoadRequest] = []
        """Loads emitted by ``update_state_after_alloc``, for the next metadata."""
        self._loading: set[str] = set()
        """Requests whose asynchronous load the workers have not reported finished."""
        self._saving: set[str] = set()
        """Requests with asynchronous saves emitted (their blocks wait for them at the end)."""
        self._parked: set[str] = set()
        """Requests given an asynchronous load and not scheduled since.  One asked again
        lost its whole load (vLLM recomputes from the first failed block, which may be
        the first): it is computed, not loaded again, or a chunk that fails every time
        would park it forever."""
        self._delayed: list[str] = []
        """Requests answered ``delay_free`` since the last metadata: the workers report them."""
        self._loads: dict[str, tuple[int, int]] = {}
        self._trackers: dict[str, Tracker] = {}
        self.events: ConnectorEvents | None = None
        """Set when vLLM publishes KV events: blocks stored to / loaded from the daemon (vllm/events.py)."""
        self.groups: list[GroupInfo] = []
        """vLLM's KV cache groups when there are several (:mod:`.groups`); empty: one."""
        self.init_states()

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        if request.request_id in self._parked:
            self._parked.discard(request.request_id)
            self.stats["load_retries_refused"] += 1
            return 0
        n = super().num_new_matched_tokens(request, num_computed_tokens)
        if n and self.states is not None:
            n = self._state_hit(request, num_computed_tokens)
        if n and self.cost_gate is not None:
            keep = self.cost_gate.plan(self._pieces(request.request_id, n))
            if keep < n:
                self.stats["loads_skipped_by_cost" if keep == 0 else "loads_cut_by_cost"] += 1
                self.stats["load_tokens_skipped_by_cost"] += n - keep
                return keep
        return n

    def _pieces(self, req_id: str, n: int) -> list[tuple[str | None, int]]:
        """The load of ``n`` tokens as (tier, tokens) per chunk, in order (the cost gate's input)."""
        hit = self._hits.get(req_id)
        if hit is None or not hit.tiers:
            return [(None, n)]
        start, end = hit.local_tokens, hit.local_tokens + n
        pieces: list[tuple[str | None, int]] = []
        for i, tier in enumerate(hit.tiers):
            lo, hi = max(start, i * self.chunk_size), min(end, (i + 1) * self.chunk_size)
            if hi > lo:
                pieces.append((tier, hi - lo))
        return pieces

    def saw_output(self, stats: Any) -> None:
        """The workers' stats of a step (``update_connector_output``): the load rate."""
        data = getattr(stats, "data", None)
        measured, self._measured = self._measured, []
        if self.cost_gate is None:
            return
        mix: dict[str, float] = {}
        for req_id in measured:
            for tier, n in self._load_mix.pop(req_id, {}).items():
                mix[tier] = mix.get(tier, 0) + n
        if isinstance(data, dict):
            self.cost_gate.saw_load(float(data.get("loaded_tokens", 0)), float(data.get("load_s", 0.0)), mix)

    # -- update_state_after_alloc ---------------------------------------------------
    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        req_id = request.request_id
        if self.lookups is not None:
            self.lookups.forget(req_id)  # used: a later ask (after a preemption) looks up anew
        hit = self._hits.get(req_id)
        if hit is None or num_external_tokens <= 0:
            return
        self._loads[req_id] = (hit.local_tokens, hit.local_tokens + num_external_tokens)
        root = self._roots.get(req_id)
        prompt = list(request.prompt_token_ids or [])
        wanted = self.async_load or self.states is not None  # keyed once, for the load and the state
        keyed = self.prompt_keys(prompt, root) if root is not None and wanted else None
        if self.states is not None:
            n = hit.local_tokens + num_external_tokens
            keys = keyed[0] if keyed is not None else []
            self._state_loads[req_id] = self.states.load_plan(blocks.get_block_ids(), keys, n, hit.state_tokens)
        self.stats["lookup_hit_tokens"] += num_external_tokens
        if self.cost_gate is not None:
            self._load_mix[req_id] = self.hit_sources(req_id, num_external_tokens)
        if not self.async_load:
            return
        # The request waits in WAITING_FOR_REMOTE_KVS: its load goes out with the next
        # metadata, into the blocks allocated now (from its first token on).
        if root is None or keyed is None:  # pragma: no cover - a hit implies a root
            return
        full, tail = keyed
        tracker = self._trackers.get(req_id) or Tracker(
            full, len(prompt), [], 0, tail, False, len(full) * self.chunk_size, prompt if root == ROOT_KEY else None
        )
        loads = LMCacheServerConnectorMetadata()
        block_ids, group_ids = tracker.block_ids, tracker.group_ids
        tracker.set_blocks(self._blocks(blocks.get_block_ids()))
        self._emit_load(loads, req_id, tracker)
        if req_id in self._trackers:  # the resumed request's blocks come with its next schedule
            tracker.block_ids, tracker.group_ids = block_ids, group_ids
        self._async_loads.extend(loads.loads)
        deadline = self._params.get(req_id, DEFAULT).load_deadline_s
        if deadline is not None:
            self._deadlines[req_id] = deadline
        self._loading.add(req_id)
        self._parked.add(req_id)

    def loads_finished(self, req_ids: set[str]) -> None:
        """The workers report these requests' asynchronous loads done (``update_connector_output``)."""
        self._loading.difference_update(req_ids)
        if self.async_load:
            self._measured.extend(req_ids)

    def finished(self, req_id: str) -> bool:
        """``request_finished``: forget the request; True when its blocks must wait
        for its asynchronous saves (the workers then report it in ``finished_sending``)."""
        self.forget(req_id)
        delay = self.async_save and req_id in self._saving and req_id not in self._loading
        self._saving.discard(req_id)
        if delay:
            self._delayed.append(req_id)
        return delay

    # -- build_connector_meta -------------------------------------------------------
    def build_meta(self, scheduler_output: Any) -> LMCacheServerConnectorMetadata:
        meta = LMCacheServerConnectorMetadata()
        self._idle = not scheduler_output.num_scheduled_tokens
        meta.idle = self._idle
        if self.cost_gate is not None:
            self.cost_gate.saw_step(sum(scheduler_output.num_scheduled_tokens.values()))
        meta.loads, self._async_loads = self._async_loads, []
        meta.delayed, self._delayed = self._delayed, []
        meta.load_deadlines, self._deadlines = self._deadlines, {}
        meta.preempted = sorted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        for req_id in scheduler_output.finished_req_ids:
            self.forget(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            root = self._roots.get(new.req_id, key_root(new))
            if root is None:
                continue
            prompt = list(new.prompt_token_ids or [])
            hit = self._hits.pop(new.req_id, None)
            full, tail = self.prompt_keys(prompt, root)
            hit_chunks = hit.hit_chunks if hit else 0
            tracker = Tracker(
                full,
                len(prompt),
                [],
                min(hit_chunks, len(full)),
                tail,
                hit_chunks > len(full),
                len(full) * self.chunk_size,
                prompt if root == ROOT_KEY else None,
            )
            tracker.set_blocks(self._blocks(new.block_ids))
            self._trackers[new.req_id] = tracker
            self._parked.discard(new.req_id)
            self._emit_load(meta, new.req_id, tracker)
            computed = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            self._emit_save(meta, new.req_id, tracker, computed, new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            running = self._trackers.get(req_id)
            if running is None:
                continue
            tracker = running
            self._parked.discard(req_id)
            new_blocks = self._blocks(cached.new_block_ids[i]) if cached.new_block_ids[i] is not None else []
            if resumed(cached, i, req_id):
                tracker.set_blocks(new_blocks)
                hit = self._hits.pop(req_id, None)
                if hit is not None:
                    n_prompt = tracker.tail_start // self.chunk_size  # the prompt's full chunks
                    tracker.stored_chunks = max(tracker.stored_chunks, min(hit.hit_chunks, n_prompt))
                    tracker.tail_stored = tracker.tail_stored or hit.hit_chunks > n_prompt
            else:
                tracker.set_blocks(new_blocks, extend=True)
            self._emit_load(meta, req_id, tracker)
            computed = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self._emit_save(meta, req_id, tracker, computed, cached.num_computed_tokens[i])
        if self.states is not None:
            self._emit_state_saves(meta, scheduler_output)
        if not self.async_load:
            self._measured = [load.req_id for load in meta.loads]  # loaded within this step
        return meta

    # -- request_finished -----------------------------------------------------------
    def forget(self, req_id: str) -> None:
        self._parked.discard(req_id)
        self._params.pop(req_id, None)
        self._deadlines.pop(req_id, None)
        self._hits.pop(req_id, None)
        self._roots.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._state_loads.pop(req_id, None)
        self._trackers.pop(req_id, None)
        self._waiting.pop(req_id, None)
        self._requests.pop(req_id, None)
        if req_id not in self._measured:  # else the step's stats, read after vLLM frees it, use it
            self._load_mix.pop(req_id, None)
        if self.lookups is not None:
            self.lookups.abandon(req_id)  # ended before its load: its prefetches are cancelled
