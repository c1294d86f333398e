"""What one request adds to a step's metadata: its load and its saves (a base of
:class:`~.scheduler.SchedulerSide`, which decides when).

A load covers the chunks of the span vLLM allocated for it (plus the prompt's
tail and a Mamba state where those come with it); a save covers the full
chunks the step completes past those already stored or loaded (the prompt's,
and with ``save_decode_cache`` the generated tokens' too), cut at the
request's ``max_store_tokens``, and the tail once the whole prompt is computed.
Both announce their chunks as KV events when vLLM publishes them.

Primitive: :class:`Emitting`.
"""

from __future__ import annotations

from typing import Any

from ...keys import ROOT_KEY, ChunkTokens, chunk_keys, pack_tokens
from .events import ConnectorEvents
from .groups import GroupInfo, savable
from .meta import LMCacheServerConnectorMetadata, LoadRequest, SaveRequest
from .params import DEFAULT, RequestParams
from .tracker import Tracker


class Emitting:
    """The load and save requests of one request's step."""

    chunk_size: int
    stats: dict[str, float]
    save_enabled: bool
    save_decode_cache: bool
    store_tails: bool
    async_save: bool
    events: ConnectorEvents | None
    groups: list[GroupInfo]
    _loads: dict[str, tuple[int, int]]
    _state_loads: dict[str, tuple[bytes | None, list[int] | None, int]]
    _params: dict[str, RequestParams]
    _requests: dict[str, Any]
    _roots: dict[str, bytes | None]
    _saving: set[str]

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
