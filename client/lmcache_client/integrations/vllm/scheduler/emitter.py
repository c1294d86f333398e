"""What one request adds to a step's metadata: its load and its saves (a part of
:class:`~.side.SchedulerSide`, which decides when).

A load covers the chunks of the span vLLM allocated for it (plus the prompt's
tail and a Mamba state where those come with it); a save covers the full
chunks the step completes past those already stored or loaded (the prompt's,
and with ``save_decode_cache`` the generated tokens' too), cut at the
request's ``max_store_tokens``, and the tail once the whole prompt is computed.
Both announce their chunks as KV events when vLLM publishes them.

Primitive: :class:`Emitter`.
"""

from __future__ import annotations

from collections.abc import Sequence

from ....keys import ROOT_KEY, ChunkTokens, chunk_keys, pack_tokens
from ..groups import GroupInfo, savable
from ..meta import LMCacheServerConnectorMetadata, LoadRequest, SaveRequest
from ..params import DEFAULT
from .events import ConnectorEvents
from .perrequest import PerRequest
from .tracker import Tracker


class Emitter:
    """The load and save requests of one request's step.

    ``save``: saves are made at all (not a ``kv_consumer``); ``store_tails``: a
    prompt's partial last chunk is stored too; ``save_decode_cache``: the generated
    tokens' full chunks too (unless a request says otherwise); ``async_save``: saves
    run after the step, so the request is marked ``saving``; ``events``: where KV
    events go (None: vLLM publishes none); ``groups``: vLLM's KV cache groups when
    there are several (empty: one)."""

    def __init__(
        self,
        chunk_size: int,
        book: PerRequest,
        stats: dict[str, float],
        *,
        save: bool = True,
        store_tails: bool = False,
        save_decode_cache: bool = False,
        async_save: bool = False,
        events: ConnectorEvents | None = None,
        groups: Sequence[GroupInfo] = (),
    ):
        self._chunk_size = chunk_size
        self._book = book
        """Reads each request's load span, state load, params, vLLM request and root; marks it ``saving``."""
        self._stats = stats
        self._save_enabled = save
        self._store_tails = store_tails
        self._save_decode_cache = save_decode_cache
        self._async_save = async_save
        self._events = events
        self._groups = list(groups)

    def load(self, meta: LMCacheServerConnectorMetadata, req_id: str, tracker: Tracker) -> None:
        """Load the span vLLM allocated for the request (if any, once), into ``tracker``'s blocks."""
        span = self._book.loads.pop(req_id, None)
        if span is None:
            return
        start, end = span
        n_full = len(tracker.keys)
        first = min(start // self._chunk_size, n_full)
        last = min(-(-end // self._chunk_size), n_full)
        with_tail = tracker.tail_key is not None and end > tracker.tail_start
        state_key, state_blocks, state_tokens = self._book.state_loads.pop(req_id, (None, None, 0))
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

    def save(
        self, meta: LMCacheServerConnectorMetadata, req_id: str, tracker: Tracker, computed: int, before: int = 0
    ) -> None:
        """Save what ``computed`` tokens complete; ``before``: tokens computed when the step began."""
        params = self._book.params.get(req_id, DEFAULT)
        if not self._save_enabled or params.skip_save or tracker.unsavable:
            return
        limit = tracker.prompt_len
        decode = self._save_decode_cache if params.save_decode_cache is None else params.save_decode_cache
        if decode and computed > tracker.prompt_len:
            limit = self._extend_keys(req_id, tracker, computed)
        if params.max_store_tokens is not None:
            limit = min(limit, params.max_store_tokens)
        ready = min(computed, limit) // self._chunk_size
        with_tail = (
            self._store_tails
            and tracker.tail_key is not None
            and not tracker.tail_stored
            and computed >= tracker.prompt_len
            and tracker.prompt_len <= limit
        )
        if ready <= tracker.stored_chunks and not with_tail:
            return
        first = tracker.stored_chunks
        if self._groups and not savable(self._groups, first * self._chunk_size, before):
            # A sliding-window group freed blocks of this chunk already: never store
            # what is not there; later chunks would be past a gap (groups.py).
            tracker.unsavable = True
            self._stats["saves_out_of_window"] += 1
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
        if self._async_save:
            self._book.saving.add(req_id)
        tracker.stored_chunks = max(first, ready)
        tracker.tail_stored = tracker.tail_stored or with_tail

    def _extend_keys(self, req_id: str, tracker: Tracker, computed: int) -> int:
        """Keys of the full chunks of generated tokens computed by now (``save_decode_cache``);
        returns how many tokens have keys."""
        request, root = self._book.requests.get(req_id), self._book.roots.get(req_id)
        tokens = list(getattr(request, "all_token_ids", None) or [])
        if root is None or not tokens:
            return tracker.prompt_len
        c = self._chunk_size
        end = min(computed, len(tokens)) // c * c  # a draft token's KV is not final: never past the known tokens
        have = len(tracker.keys) * c
        if end > have:
            tracker.keys.extend(chunk_keys(tokens[have:end], c, tracker.keys[-1] if tracker.keys else root))
            if tracker.prompt is not None:
                tracker.prompt = tokens[: max(end, len(tracker.prompt))]
        return max(tracker.prompt_len, len(tracker.keys) * c)

    def _announce(self, req_id: str, tracker: Tracker, first: int, end: int) -> None:
        """KV events for full chunks ``first .. end - 1`` (stored or loaded), when vLLM publishes them."""
        request = self._book.requests.get(req_id)
        if self._events is not None and request is not None and tracker.prompt is not None and end > first:
            self._events.chunks(request, first, end, tracker.prompt)

    def _chunk_tokens(self, tracker: Tracker, first: int, end: int) -> list[ChunkTokens] | None:
        """Parent key and token ids of full chunks ``first .. end - 1`` (KV events)."""
        if tracker.prompt is None or end <= first:
            return None
        c, prompt, keys = self._chunk_size, tracker.prompt, tracker.keys
        return [
            ChunkTokens(keys[i - 1] if i else ROOT_KEY, pack_tokens(prompt[i * c : (i + 1) * c]))
            for i in range(first, end)
        ]
