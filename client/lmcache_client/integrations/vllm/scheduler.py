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

from ...keys import ROOT_KEY, ChunkTokens, chunk_keys, pack_tokens
from ..transfer import ChunkTransfer
from .compat import resumed
from .costgate import CostGate
from .events import ConnectorEvents
from .groups import GroupInfo, savable
from .lookups import LookupService
from .matching import Matcher, key_root
from .meta import LMCacheServerConnectorMetadata, LoadRequest, SaveRequest
from .params import DEFAULT
from .statescheduler import StateScheduling
from .tracker import Tracker

logger = logging.getLogger(__name__)


class SchedulerSide(StateScheduling, Matcher):
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

    def _emit_load(self, meta: LMCacheServerConnectorMetadata, req_id: str, tracker: Tracker) -> None:
        span = self._loads.pop(req_id, None)
        if span is None:
            return
        start, end = span
        n_full = len(tracker.keys)
        first = min(start // self.chunk_size, n_full)
        last = min(-(-end // self.chunk_size), n_full)
        with_tail = tracker.tail_key is not None and end > tracker.tail_start
        state_key, state_blocks, state_tokens = self._state_loads.pop(req_id, (None, None, 0))
        meta.loads.append(
            LoadRequest(
                req_id,
                tracker.keys[first:last],
                first,
                start,
                end,
                list(tracker.block_ids),
                tracker.tail_key if with_tail else None,
                tracker.prompt_len - tracker.tail_start if with_tail else 0,
                tracker.groups_copy(),
                state_tokens,
                state_key,
                state_blocks,
            )
        )
        self._announce(req_id, tracker, first, last)
        tracker.stored_chunks = max(tracker.stored_chunks, last)
        tracker.tail_stored = tracker.tail_stored or with_tail

    def _emit_save(
        self, meta: LMCacheServerConnectorMetadata, req_id: str, tracker: Tracker, computed: int, before: int = 0
    ) -> None:
        """Save what ``computed`` tokens complete; ``before``: tokens computed when the step began."""
        params = self._params.get(req_id, DEFAULT)
        if not self.save_enabled or params.skip_save or tracker.unsavable:
            return
        limit = tracker.prompt_len
        decode = self.save_decode_cache if params.save_decode_cache is None else params.save_decode_cache
        if decode and computed > tracker.prompt_len:
            limit = self._extend_keys(req_id, tracker, computed)
        if params.max_store_tokens is not None:
            limit = min(limit, params.max_store_tokens)
        ready = min(computed, limit) // self.chunk_size
        with_tail = (
            self.store_tails
            and tracker.tail_key is not None
            and not tracker.tail_stored
            and computed >= tracker.prompt_len
            and tracker.prompt_len <= limit
        )
        if ready <= tracker.stored_chunks and not with_tail:
            return
        first = tracker.stored_chunks
        if self.groups and not savable(self.groups, first * self.chunk_size, before):
            # A sliding-window group freed blocks of this chunk already: never store
            # what is not there; later chunks would be past a gap (groups.py).
            tracker.unsavable = True
            self.stats["saves_out_of_window"] += 1
            return
        meta.saves.append(
            SaveRequest(
                req_id,
                tracker.keys[first:ready] if ready > first else [],
                first,
                list(tracker.block_ids),
                tracker.tail_key if with_tail else None,
                tracker.tail_start,
                tracker.prompt_len - tracker.tail_start if with_tail else 0,
                self._chunk_tokens(tracker, first, ready),
                tracker.groups_copy(),
            )
        )
        self._announce(req_id, tracker, first, ready)
        if self.async_save:
            self._saving.add(req_id)
        tracker.stored_chunks = max(first, ready)
        tracker.tail_stored = tracker.tail_stored or with_tail

    def _extend_keys(self, req_id: str, tracker: Tracker, computed: int) -> int:
        """Keys of the full chunks of generated tokens computed by now (``save_decode_cache``);
        returns how many tokens have keys."""
        request, root = self._requests.get(req_id), self._roots.get(req_id)
        tokens = list(getattr(request, "all_token_ids", None) or [])
        if root is None or not tokens:
            return tracker.prompt_len
        c = self.chunk_size
        end = min(computed, len(tokens)) // c * c  # a draft token's KV is not final: never past the known tokens
        have = len(tracker.keys) * c
        if end > have:
            tracker.keys.extend(chunk_keys(tokens[have:end], c, tracker.keys[-1] if tracker.keys else root))
            if tracker.prompt is not None:
                tracker.prompt = tokens[: max(end, len(tracker.prompt))]
        return max(tracker.prompt_len, len(tracker.keys) * c)

    def _announce(self, req_id: str, tracker: Tracker, first: int, end: int) -> None:
        """KV events for full chunks ``first .. end - 1`` (stored or loaded), when vLLM publishes them."""
        request = self._requests.get(req_id)
        if self.events is not None and request is not None and tracker.prompt is not None and end > first:
            self.events.chunks(request, first, end, tracker.prompt)

    def _chunk_tokens(self, tracker: Tracker, first: int, end: int) -> list[ChunkTokens] | None:
        """Parent key and token ids of full chunks ``first .. end - 1`` (KV events)."""
        if tracker.prompt is None or end <= first:
            return None
        c, prompt, keys = self.chunk_size, tracker.prompt, tracker.keys
        return [
            ChunkTokens(keys[i - 1] if i else ROOT_KEY, pack_tokens(prompt[i * c : (i + 1) * c]))
            for i in range(first, end)
        ]

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
