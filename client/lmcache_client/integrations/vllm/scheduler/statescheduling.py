"""The scheduler side's part for Mamba / GDN hybrids (:mod:`..states`): a part of
:class:`~.side.SchedulerSide`, built only when the model has Mamba groups.

A hit ends only where a state of exactly that length is stored; a load
carries the state's key and blocks (:meth:`..states.StateWiring.load_plan`);
each step's boundary hand-offs at a chunk's end become state saves.

Primitive: :class:`StateScheduling`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .... import keys as key_chain
from ...transfer import ChunkTransfer
from ..meta import LMCacheServerConnectorMetadata
from ..params import DEFAULT
from ..states import StateWiring
from .lookups import LookupService, Then
from .perrequest import PerRequest


class StateScheduling:
    """State lookups, loads and saves of the scheduler side.

    ``state_transfers`` has one entry per tensor-parallel rank, in the states'
    namespace; ``lookups``: the asynchronous lookups whose answers carry each
    rank's state hit (None: the scheduler asks the daemon itself)."""

    def __init__(
        self,
        states: StateWiring,
        state_transfers: Sequence[ChunkTransfer],
        chunk_size: int,
        book: PerRequest,
        stats: dict[str, float],
        *,
        lookups: LookupService | None = None,
        save: bool = True,
    ):
        self._states = states
        self._state_transfers = list(state_transfers)
        self._chunk_size = chunk_size
        self._book = book
        """Reads each request's vLLM request, root, params and tracker; trims its hit; writes its state load."""
        self._stats = stats
        self._lookups = lookups
        self._save_enabled = save

    def blocks(self, block_ids: Any) -> Any:
        """vLLM's block ids as the chunks see them (the attention groups')."""
        return self._states.attention_blocks(block_ids)

    def lookup_then(self, req_id: str, full: list[bytes]) -> Then | None:
        """Asynchronous lookups: each rank's lane also finds the longest stored state the
        rank's chunk hit allows, so the scheduler never waits on the daemon for it;
        ``full``: the keys of the prompt's full chunks."""
        states, request = self._states, self._book.requests.get(req_id)
        if request is None:
            return None
        prompt_len = len(request.prompt_token_ids or [])
        ranks = [(t.raw_namespace, t.chunk_bytes) for t in self._state_transfers]

        def then(transfer: ChunkTransfer, rank: int, tiers: list[str]) -> int:
            namespace, state_bytes = ranks[rank]
            over = ChunkTransfer(transfer.client, namespace, state_bytes, codec="none")
            return states.hit(full, len(tiers), prompt_len, lambda key: over.lookup([key]) == 1)

        return then

    def hit(self, request: Any, num_computed_tokens: int) -> int:
        """A Mamba hybrid's hit: only up to a stored state of exactly that length (:mod:`..states`).
        Asynchronous lookups found it on the lanes; where ranks disagree (tensor parallelism)
        or there was no such lookup, the scheduler asks the daemon here."""
        hit, root = self._book.hits.get(request.request_id), self._book.roots.get(request.request_id)
        if hit is None or root is None:
            return 0
        prompt = list(request.prompt_token_ids or [])
        full, _ = key_chain.prompt_keys(prompt, self._chunk_size, root)

        def stored(key: bytes) -> bool:
            return all(t.lookup([key]) == 1 for t in self._state_transfers)

        answer = self._lookups.answer(request.request_id) if self._lookups is not None else None
        found = answer.then if answer is not None else []
        if found and all(isinstance(n, int) for n in found) and len(set(found)) == 1:
            n = int(found[0])
        else:
            self._stats["state_lookups_in_step"] += 1
            n = self._states.hit(full, hit.hit_chunks, len(prompt), stored)
        hit.hit_chunks = n // self._chunk_size  # never the tail: no state ends there
        hit.tiers = hit.tiers[: hit.hit_chunks]
        hit.state_tokens = n
        return max(0, n - num_computed_tokens)

    def plan_load(self, req_id: str, block_ids: Any, keys: list[bytes], tokens: int, state_tokens: int) -> None:
        """The state load that goes with the request's load of ``tokens`` tokens (:meth:`.StateWiring.load_plan`)."""
        self._book.state_loads[req_id] = self._states.load_plan(block_ids, keys, tokens, state_tokens)

    def emit_saves(self, meta: LMCacheServerConnectorMetadata, scheduler_output: Any) -> None:
        """Store the Mamba states vLLM hands off in this step at a full chunk's end (:mod:`..states`)."""
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offloads = getattr(block_state, "boundary_state_offloads", None) or {}
        if not self._save_enabled:
            return
        for req_id, entries in offloads.items():
            tracker = self._book.trackers.get(req_id)
            if tracker is None or self._book.params.get(req_id, DEFAULT).skip_save:
                continue
            meta.state_saves.extend(self._states.saves(req_id, entries, tracker.keys))
