"""Scheduler side of the vLLM connector: what to load and what to store, per step.

vLLM calls, for a waiting request:

1. ``get_num_new_matched_tokens(request, num_computed_tokens)``: the daemon is
   asked how many leading chunks of the prompt it holds, and the prompt's
   partial last chunk (its *tail*, stored under a key naming the exact prompt:
   :func:`~lmcache_client.keys.tail_key`); everything up to the last prompt
   token can be loaded, the last token is always computed so the request gets
   logits.  Under tensor parallelism every rank's namespace is asked and the
   smallest answer counts.  The answer is the hit beyond vLLM's own prefix
   cache (``num_computed_tokens``, block aligned).  A consumer that waits for a
   producer (``load_wait_s``) answers None ("ask again") until the whole prompt
   is there or the deadline passes, then takes what is there.  Calls have no
   effect beyond remembering the latest answer, so vLLM may repeat them.
2. ``update_state_after_alloc(request, blocks, num_external_tokens)``: vLLM
   allocated blocks for ``num_external_tokens`` tokens; they become a load.
3. ``build_connector_meta(scheduler_output)``: loads of newly scheduled
   requests, and a save of every full prompt chunk that becomes computed in
   this step (and of the tail, once the whole prompt is computed, where tails
   are stored: a ``kv_producer``, or ``store_tails``); a request tracker follows
   each request's blocks across chunked prefill and preemption.
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
import math
import time
from collections.abc import Sequence
from typing import Any

from ...keys import ROOT_KEY, ChunkTokens, chunk_keys, pack_tokens, salted_root, tail_key
from ..transfer import ChunkTransfer
from .compat import first_group, resumed
from .events import ConnectorEvents
from .meta import LMCacheServerConnectorMetadata, LoadRequest, SaveRequest

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Hit:
    local_tokens: int
    """Tokens vLLM had computed (its own prefix cache) when asked."""
    hit_chunks: int
    """Leading chunks the daemon holds, the tail counting as the chunk after the full ones."""
    tiers: list[str] = dataclasses.field(default_factory=list)
    """The daemon tier of each hit chunk (the first rank's)."""


@dataclasses.dataclass
class _Wait:
    first: float
    """When the request was first found incomplete (monotonic seconds)."""
    last: float
    """When the daemon was last asked."""


@dataclasses.dataclass
class _Tracker:
    keys: list[bytes]
    """Keys of every full chunk of the prompt."""
    prompt_len: int
    block_ids: list[int]
    stored_chunks: int
    """Leading full chunks the daemon holds already (found by lookup or saved)."""
    tail_key: bytes | None = None
    """Key of the prompt's partial last chunk (None: no tail of 2+ tokens)."""
    tail_stored: bool = False
    tail_start: int = 0
    """First token of the tail (the end of the last full chunk)."""
    prompt: list[int] | None = None
    """The prompt's token ids, for KV events (None: a salted chain, not announced)."""


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

    POLL_S = 0.01
    """While a request waits for a producer, the daemon is asked at most this often;
    and when the engine has nothing else to run, each ask sleeps this long first."""

    def __init__(
        self,
        transfers: Sequence[ChunkTransfer],
        chunk_size: int,
        *,
        load: bool = True,
        save: bool = True,
        store_tails: bool = False,
        load_wait_s: float = 0.0,
    ):
        self.transfers = list(transfers)
        self.chunk_size = chunk_size
        self.load_enabled = load
        self.save_enabled = save
        self.store_tails = store_tails
        self.load_wait_s = load_wait_s
        self._hits: dict[str, _Hit] = {}
        self._roots: dict[str, bytes | None] = {}
        self._loads: dict[str, tuple[int, int]] = {}
        self._trackers: dict[str, _Tracker] = {}
        self._waiting: dict[str, _Wait] = {}
        self._requests: dict[str, Any] = {}  # vLLM's Request objects, for their block hashes (events)
        self.events: ConnectorEvents | None = None
        """Set when vLLM publishes KV events: blocks stored to / loaded from the daemon (vllm/events.py)."""
        self._idle = False
        """The last step scheduled nothing (so a wait may sleep: no decode is held up)."""
        self.stats = {
            "lookups": 0,
            "lookup_hit_tokens": 0,
            "lookup_s": 0.0,
            "load_waits": 0,
            "load_wait_s": 0.0,
            "load_wait_expired": 0,
        }

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

    def prompt_keys(self, prompt: Sequence[int], root: bytes) -> tuple[list[bytes], bytes | None]:
        """Keys of every full chunk of ``prompt`` and of its tail (None unless the
        prompt ends in a partial chunk of two or more tokens: a one-token tail
        holds only the last token, which is always computed)."""
        keys = chunk_keys(prompt, self.chunk_size, root)
        start = len(keys) * self.chunk_size
        if len(prompt) - start < 2:
            return keys, None
        return keys, tail_key(keys[-1] if keys else root, prompt[start:])

    def _daemon_down(self) -> bool:
        """Whether the daemon is down (its client's circuit breaker is open)."""
        return any(bool(t.client.fail_open_stats.get("down")) for t in self.transfers)

    def _wait_s(self, request: Any) -> float:
        """How long this request waits for a producer: ``load_wait_s``, or the
        request's ``kv_transfer_params["lmcache_load_wait_s"]`` (a proxy's say),
        never more than ``load_wait_s``: the request comes from an end user, and
        an unbounded wait would hold the engine's scheduler slot forever."""
        params = getattr(request, "kv_transfer_params", None)
        if isinstance(params, dict) and "lmcache_load_wait_s" in params:
            try:
                asked = float(params["lmcache_load_wait_s"])
            except (TypeError, ValueError):
                asked = math.nan
            if math.isnan(asked):
                logger.warning(
                    "request %s: ignoring lmcache_load_wait_s=%r", request.request_id, params["lmcache_load_wait_s"]
                )
            else:
                return min(max(0.0, asked), self.load_wait_s)
        return self.load_wait_s

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        req_id = request.request_id
        prompt = request.prompt_token_ids
        root = key_root(request)
        self._roots[req_id] = root
        if self.events is not None:
            self._requests[req_id] = request
        if not prompt or root is None or not self.load_enabled:
            return 0
        n = len(prompt)
        full, tail = self.prompt_keys(prompt, root)
        best = n - 1 if tail is not None else min(n - 1, len(full) * self.chunk_size)
        if best <= num_computed_tokens:
            return 0  # vLLM's own cache already holds every token the daemon could add
        keys = full + [tail] if tail is not None else full
        wait_s = self._wait_s(request)
        now = time.monotonic()
        waiting = self._waiting.get(req_id)
        if waiting is not None and self._idle:
            # vLLM's engine loop spins while a request is deferred; with nothing else to
            # run it would take whole cores from the producer it is waiting for.
            time.sleep(self.POLL_S)
            now = time.monotonic()
        elif waiting is not None and now - waiting.last < self.POLL_S:
            return None
        started = time.perf_counter()
        tiers = self.lookup(keys)
        self.stats["lookups"] += 1
        self.stats["lookup_s"] += time.perf_counter() - started
        daemon_down = self._daemon_down()  # nothing will arrive: do not wait
        if len(tiers) < len(keys) and wait_s > 0 and not daemon_down:
            if waiting is None:
                self.stats["load_waits"] += 1
                waiting = self._waiting[req_id] = _Wait(now, now)
            if now - waiting.first < wait_s:
                waiting.last = now
                return None
            self.stats["load_wait_expired"] += 1
            logger.warning(
                "request %s: %d of %d chunks arrived in %.1f s (load_wait_s); computing the rest",
                req_id,
                len(tiers),
                len(keys),
                wait_s,
            )
        if waiting is not None:
            self.stats["load_wait_s"] += now - waiting.first
            del self._waiting[req_id]
        self._hits[req_id] = _Hit(num_computed_tokens, len(tiers), tiers)
        covered = n if len(tiers) > len(full) else len(tiers) * self.chunk_size
        return max(0, min(covered, n - 1) - num_computed_tokens)

    # -- update_state_after_alloc ---------------------------------------------------
    def after_alloc(self, req_id: str, num_external_tokens: int) -> None:
        hit = self._hits.get(req_id)
        if hit is not None and num_external_tokens > 0:
            self._loads[req_id] = (hit.local_tokens, hit.local_tokens + num_external_tokens)
            self.stats["lookup_hit_tokens"] += num_external_tokens

    # -- build_connector_meta -------------------------------------------------------
    def build_meta(self, scheduler_output: Any) -> LMCacheServerConnectorMetadata:
        meta = LMCacheServerConnectorMetadata()
        self._idle = not scheduler_output.num_scheduled_tokens
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
            tracker = _Tracker(
                full,
                len(prompt),
                first_group(new.block_ids),
                min(hit_chunks, len(full)),
                tail,
                hit_chunks > len(full),
                len(full) * self.chunk_size,
                prompt if root == ROOT_KEY else None,
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
                    tracker.stored_chunks = max(tracker.stored_chunks, min(hit.hit_chunks, len(tracker.keys)))
                    tracker.tail_stored = tracker.tail_stored or hit.hit_chunks > len(tracker.keys)
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
        n_full = len(tracker.keys)
        first = min(start // self.chunk_size, n_full)
        last = min(-(-end // self.chunk_size), n_full)
        with_tail = tracker.tail_key is not None and end > tracker.tail_start
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
            )
        )
        self._announce(req_id, tracker, first, last)
        tracker.stored_chunks = max(tracker.stored_chunks, last)
        tracker.tail_stored = tracker.tail_stored or with_tail

    def _emit_save(self, meta: LMCacheServerConnectorMetadata, req_id: str, tracker: _Tracker, computed: int) -> None:
        if not self.save_enabled:
            return
        ready = min(computed, tracker.prompt_len) // self.chunk_size
        with_tail = (
            self.store_tails
            and tracker.tail_key is not None
            and not tracker.tail_stored
            and computed >= tracker.prompt_len
        )
        if ready <= tracker.stored_chunks and not with_tail:
            return
        first = tracker.stored_chunks
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
            )
        )
        self._announce(req_id, tracker, first, ready)
        tracker.stored_chunks = max(first, ready)
        tracker.tail_stored = tracker.tail_stored or with_tail

    def _announce(self, req_id: str, tracker: _Tracker, first: int, end: int) -> None:
        """KV events for full chunks ``first .. end - 1`` (stored or loaded), when vLLM publishes them."""
        request = self._requests.get(req_id)
        if self.events is not None and request is not None and tracker.prompt is not None and end > first:
            self.events.chunks(request, first, end, tracker.prompt)

    def _chunk_tokens(self, tracker: _Tracker, first: int, end: int) -> list[ChunkTokens] | None:
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
        self._hits.pop(req_id, None)
        self._roots.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._trackers.pop(req_id, None)
        self._waiting.pop(req_id, None)
        self._requests.pop(req_id, None)
