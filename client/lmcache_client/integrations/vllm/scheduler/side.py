"""Scheduler side of the vLLM connector: what to load and what to store, per step.

vLLM calls, for a waiting request:

1. ``get_num_new_matched_tokens(request, num_computed_tokens)``: how many
   tokens the daemon can add (:class:`~.matcher.Matcher`); with asynchronous
   loads (the default) the request then waits in vLLM's
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

:class:`SchedulerSide` is the front: it builds and holds its parts, all
sharing one :class:`~.perrequest.PerRequest` record and one stats dict:

- :class:`~.matcher.Matcher`: how much the daemon holds of a waiting request;
- :class:`~.emitter.Emitter`: a request's load and saves in a step's metadata;
- :class:`~.statescheduling.StateScheduling`: a Mamba hybrid's state hits,
  loads and saves (None without Mamba groups);
- :class:`~.loadcosts.LoadCosts`: the cost gate's cuts and samples (None
  without ``cost_gate``).

The front itself decides when: the trackers across chunked prefill and
preemption, and the asynchronous loads (parked, loading, delayed frees).

Primitive: :class:`SchedulerSide`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ....keys import ROOT_KEY
from ...transfer import ChunkTransfer
from ..compat import resumed
from ..groups import GroupInfo
from ..meta import LMCacheServerConnectorMetadata, LoadRequest
from ..params import DEFAULT
from ..states import StateWiring
from .costgate import CostGate
from .emitter import Emitter
from .events import ConnectorEvents
from .loadcosts import LoadCosts
from .lookups import LookupService
from .matcher import Matcher, key_root
from .perrequest import PerRequest
from .sources import PromptSources
from .statescheduling import StateScheduling
from .tracker import Tracker

logger = logging.getLogger(__name__)

STATS = (
    "lookups",
    "lookup_hit_tokens",
    "lookup_s",
    "load_waits",
    "load_wait_s",
    "load_wait_expired",
    "load_retries_refused",
    "loads_skipped_by_cost",
    "saves_out_of_window",
    "state_lookups_in_step",
    "loads_cut_by_cost",
    "load_tokens_skipped_by_cost",
)
"""The scheduler side's counters (``take_stats``), in the order vLLM's stats show them."""


class SchedulerSide:
    """Per-request bookkeeping of the scheduler process (single-threaded, as vLLM's scheduler).

    ``transfers`` has one entry per tensor-parallel rank (the rank's namespace);
    saves and loads are the workers' business, the scheduler only looks up
    (:class:`~.matcher.Matcher`) and tells them what to move.  ``events``: where KV
    events go (:mod:`.events`; None: vLLM publishes none); ``groups``: vLLM's KV
    cache groups when there are several (:mod:`..groups`; empty: one); ``states``
    and ``state_transfers`` (one per rank, in the states' namespace): a Mamba
    hybrid's groups (:mod:`..states`; None: no Mamba group)."""

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
        events: ConnectorEvents | None = None,
        groups: Sequence[GroupInfo] = (),
        states: StateWiring | None = None,
        state_transfers: Sequence[ChunkTransfer] = (),
    ):
        self.transfers = list(transfers)
        self.chunk_size = chunk_size
        self.lookups = lookups
        """Asynchronous lookups (:mod:`.lookups`); None: each lookup waits for the daemon."""
        self.cost_gate = cost_gate
        """Skips loads slower than computing them (:mod:`.costgate`); None: every load runs."""
        self.async_load = async_load
        """Loads run while the request waits in WAITING_FOR_REMOTE_KVS (:mod:`..worker.transferengine`)."""
        self.async_save = async_save
        """Saves run after the step; a finished request's blocks wait for them."""
        self.stats: dict[str, float] = dict.fromkeys(STATS, 0)
        """Counters since the last ``take_stats``, shared by the parts (zeroed in place)."""
        self.per_request = PerRequest()
        """What the parts share per request."""
        self._load, self._save, self._store_tails = load, save, store_tails
        self._load_wait_s, self._save_decode_cache = load_wait_s, save_decode_cache
        self._max_store_tokens, self._load_deadline_ms = max_store_tokens, load_deadline_ms
        self._events, self._groups = events, list(groups)
        self._states, self._state_transfers = states, list(state_transfers)
        self._idle = False
        """The last step scheduled nothing (so a wait may sleep: no decode is held up)."""
        self._async_loads: list[LoadRequest] = []
        """Loads emitted by ``update_state_after_alloc``, for the next metadata."""
        self._deadlines: dict[str, float] = {}
        """Per-request load deadlines (seconds) for the next metadata."""
        self._loading: set[str] = set()
        """Requests whose asynchronous load the workers have not reported finished."""
        self._parked: set[str] = set()
        """Requests given an asynchronous load and not scheduled since.  One asked again
        lost its whole load (vLLM recomputes from the first failed block, which may be
        the first): it is computed, not loaded again, or a chunk that fails every time
        would park it forever."""
        self._delayed: list[str] = []
        """Requests answered ``delay_free`` since the last metadata: the workers report them."""
        book = self.per_request
        self._sources = PromptSources(self.stats)
        self._costs = LoadCosts(cost_gate, chunk_size, book, self.stats) if cost_gate is not None else None
        stats = self.stats
        self._state_scheduling = (
            StateScheduling(
                self._states, self._state_transfers, self.chunk_size, book, stats, lookups=self.lookups, save=self._save
            )
            if self._states is not None
            else None
        )
        self._matcher = Matcher(
            self.transfers,
            self.chunk_size,
            book,
            stats,
            load=self._load,
            load_wait_s=self._load_wait_s,
            lookups=self.lookups,
            max_store_tokens=self._max_store_tokens,
            load_deadline_ms=self._load_deadline_ms,
            states=self._state_scheduling,
        )
        self._emitter = Emitter(
            self.chunk_size,
            book,
            stats,
            save=self._save,
            store_tails=self._store_tails,
            save_decode_cache=self._save_decode_cache,
            async_save=self.async_save,
            events=self._events,
            groups=self._groups,
        )

    # -- what the connector built it with ----------------------------------------------
    @property
    def events(self) -> ConnectorEvents | None:
        """Where KV events go (``take_events``); None: vLLM publishes none."""
        return self._events

    @property
    def groups(self) -> list[GroupInfo]:
        """vLLM's KV cache groups when there are several (:mod:`..groups`); empty: one."""
        return self._groups

    @property
    def states(self) -> StateWiring | None:
        """A Mamba hybrid's groups (:mod:`..states`); None: no Mamba group."""
        return self._states

    @property
    def state_transfers(self) -> list[ChunkTransfer]:
        """One per rank, in the states' namespace (with ``states``)."""
        return self._state_transfers

    # -- what the connector reads ----------------------------------------------------
    @property
    def transfer(self) -> ChunkTransfer:
        """The first rank's transfer."""
        return self.transfers[0]

    def take_stats(self) -> dict[str, float]:
        """The counters since the last call (then zeroed)."""
        data = dict(self.stats)
        for name in self.stats:
            self.stats[name] = 0
        return data

    def lookup(self, keys: list[bytes]) -> list[str]:
        """The tiers of the leading chunks every rank's namespace holds (:meth:`.Matcher.lookup`)."""
        return self._matcher.lookup(keys)

    def hit_sources(self, req_id: str, num_external_tokens: int) -> dict[str, int]:
        """Tokens of the request's load per daemon tier (:meth:`.Matcher.hit_sources`)."""
        return self._matcher.hit_sources(req_id, num_external_tokens)

    def prompt_keys(self, prompt: Sequence[int], root: bytes) -> tuple[list[bytes], bytes | None]:
        """Keys of ``prompt``'s full chunks and of its tail (:meth:`.Matcher.prompt_keys`)."""
        return self._matcher.prompt_keys(prompt, root)

    def _blocks(self, block_ids: Any) -> Any:
        """vLLM's block ids as the chunks see them (a Mamba hybrid's attention groups)."""
        return self._state_scheduling.blocks(block_ids) if self._state_scheduling is not None else block_ids

    # -- get_num_new_matched_tokens ----------------------------------------------------
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens to load beyond vLLM's own hit; None: ask again next step."""
        if request.request_id in self._parked:
            self._parked.discard(request.request_id)
            self.stats["load_retries_refused"] += 1
            return 0
        self._sources.asked(request.request_id, num_computed_tokens)
        n = self._matcher.num_new_matched_tokens(request, num_computed_tokens, self._idle)
        if n and self._state_scheduling is not None:
            n = self._state_scheduling.hit(request, num_computed_tokens)
        if n and self._costs is not None:
            return self._costs.cut(request.request_id, n)
        return n

    def saw_output(self, stats: Any) -> None:
        """The workers' stats of a step (``update_connector_output``): the load rate."""
        if self._costs is not None:
            self._costs.saw_output(stats)

    # -- update_state_after_alloc ---------------------------------------------------
    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """``update_state_after_alloc``: vLLM allocated ``blocks`` for the request's
        ``num_external_tokens`` tokens; they become its load (asynchronous: now)."""
        req_id = request.request_id
        if self.lookups is not None:
            self.lookups.forget(req_id)  # used: a later ask (after a preemption) looks up anew
        hit = self.per_request.hits.get(req_id)
        by_tier = self.hit_sources(req_id, num_external_tokens)
        self._sources.admitted(request, num_external_tokens, by_tier)
        if hit is None or num_external_tokens <= 0:
            return
        self.per_request.loads[req_id] = (hit.local_tokens, hit.local_tokens + num_external_tokens)
        root = self.per_request.roots.get(req_id)
        prompt = list(request.prompt_token_ids or [])
        wanted = self.async_load or self._state_scheduling is not None  # keyed once, for the load and the state
        keyed = self.prompt_keys(prompt, root) if root is not None and wanted else None
        if self._state_scheduling is not None:
            n = hit.local_tokens + num_external_tokens
            keys = keyed[0] if keyed is not None else []
            self._state_scheduling.plan_load(req_id, blocks.get_block_ids(), keys, n, hit.state_tokens)
        self.stats["lookup_hit_tokens"] += num_external_tokens
        if self._costs is not None:
            self._costs.allocated(req_id, by_tier)
        if not self.async_load:
            return
        # The request waits in WAITING_FOR_REMOTE_KVS: its load goes out with the next
        # metadata, into the blocks allocated now (from its first token on).
        if root is None or keyed is None:  # pragma: no cover - a hit implies a root
            return
        full, tail = keyed
        tracker = self.per_request.trackers.get(req_id) or Tracker(
            full, len(prompt), [], 0, tail, False, len(full) * self.chunk_size, prompt if root == ROOT_KEY else None
        )
        loads = LMCacheServerConnectorMetadata()
        block_ids, group_ids = tracker.block_ids, tracker.group_ids
        tracker.set_blocks(self._blocks(blocks.get_block_ids()))
        self._emitter.load(loads, req_id, tracker)
        if req_id in self.per_request.trackers:  # the resumed request's blocks come with its next schedule
            tracker.block_ids, tracker.group_ids = block_ids, group_ids
        self._async_loads.extend(loads.loads)
        deadline = self.per_request.params.get(req_id, DEFAULT).load_deadline_s
        if deadline is not None:
            self._deadlines[req_id] = deadline
        self._loading.add(req_id)
        self._parked.add(req_id)

    def loads_finished(self, req_ids: set[str]) -> None:
        """The workers report these requests' asynchronous loads done (``update_connector_output``)."""
        self._loading.difference_update(req_ids)
        if self.async_load and self._costs is not None:
            self._costs.loaded(req_ids)

    def finished(self, req_id: str) -> bool:
        """``request_finished``: forget the request; True when its blocks must wait
        for its asynchronous saves (the workers then report it in ``finished_sending``)."""
        self.forget(req_id)
        delay = self.async_save and req_id in self.per_request.saving and req_id not in self._loading
        self.per_request.saving.discard(req_id)
        if delay:
            self._delayed.append(req_id)
        return delay

    def prompt_sources(self, req_id: str) -> dict[str, int] | None:
        """The request's prompt tokens by source (:mod:`.sources`), taken once at its end;
        None when it was never admitted."""
        return self._sources.take(req_id)

    # -- build_connector_meta -------------------------------------------------------
    def build_meta(self, scheduler_output: Any) -> LMCacheServerConnectorMetadata:
        """``build_connector_meta``: the step's loads and saves, for the workers."""
        meta = LMCacheServerConnectorMetadata()
        self._idle = not scheduler_output.num_scheduled_tokens
        meta.idle = self._idle
        if self._costs is not None:
            self._costs.step_began(sum(scheduler_output.num_scheduled_tokens.values()))
        meta.loads, self._async_loads = self._async_loads, []
        meta.delayed, self._delayed = self._delayed, []
        meta.load_deadlines, self._deadlines = self._deadlines, {}
        meta.preempted = sorted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        for req_id in scheduler_output.finished_req_ids:
            self.forget(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            root = self.per_request.roots.get(new.req_id, key_root(new))
            if root is None:
                continue
            prompt = list(new.prompt_token_ids or [])
            hit = self.per_request.hits.pop(new.req_id, None)
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
            self.per_request.trackers[new.req_id] = tracker
            self._parked.discard(new.req_id)
            self._emitter.load(meta, new.req_id, tracker)
            computed = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            self._emitter.save(meta, new.req_id, tracker, computed, new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            running = self.per_request.trackers.get(req_id)
            if running is None:
                continue
            tracker = running
            self._parked.discard(req_id)
            new_blocks = self._blocks(cached.new_block_ids[i]) if cached.new_block_ids[i] is not None else []
            if resumed(cached, i, req_id):
                tracker.set_blocks(new_blocks)
                hit = self.per_request.hits.pop(req_id, None)
                if hit is not None:
                    n_prompt = tracker.tail_start // self.chunk_size  # the prompt's full chunks
                    tracker.stored_chunks = max(tracker.stored_chunks, min(hit.hit_chunks, n_prompt))
                    tracker.tail_stored = tracker.tail_stored or hit.hit_chunks > n_prompt
            else:
                tracker.set_blocks(new_blocks, extend=True)
            self._emitter.load(meta, req_id, tracker)
            computed = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self._emitter.save(meta, req_id, tracker, computed, cached.num_computed_tokens[i])
        if self._state_scheduling is not None:
            self._state_scheduling.emit_saves(meta, scheduler_output)
        if not self.async_load and self._costs is not None:
            self._costs.loaded_in_step(load.req_id for load in meta.loads)  # loaded within this step
        return meta

    # -- request_finished -----------------------------------------------------------
    def forget(self, req_id: str) -> None:
        """Drop everything kept for the request (it finished, or vLLM freed it)."""
        self._parked.discard(req_id)
        self._deadlines.pop(req_id, None)
        self.per_request.forget(req_id)
        self._sources.take(req_id)
        if self._costs is not None:
            self._costs.forget(req_id)
        if self.lookups is not None:
            self.lookups.abandon(req_id)  # ended before its load: its prefetches are cancelled
