"""The scheduler side's part for Mamba / GDN hybrids (:mod:`.states`): a base of
:class:`~.scheduler.SchedulerSide`.

A hit ends only where a state of exactly that length is stored; a load
carries the state's key and blocks (:meth:`.StateWiring.load_plan`); each
step's boundary hand-offs at a chunk's end become state saves.

Primitive: :class:`StateScheduling`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..transfer import ChunkTransfer
from .matching import Matcher
from .meta import LMCacheServerConnectorMetadata
from .params import DEFAULT
from .states import StateWiring

if TYPE_CHECKING:
    from .lookups import LookupService, Then


class StateScheduling(Matcher):
    """State lookups, loads and saves of the scheduler side (inert without ``states``)."""

    _trackers: dict[str, Any]
    _requests: dict[str, Any]
    save_enabled: bool
    lookups: LookupService | None

    def init_states(self) -> None:
        """Set up the (empty) state fields; the connector sets ``states`` for a Mamba hybrid."""
        self.states: StateWiring | None = None
        """A Mamba hybrid's groups (:mod:`.states`); None: no Mamba group."""
        self.state_transfers: list[ChunkTransfer] = []
        """One per rank, in the states' namespace (with ``states``)."""
        self._state_loads: dict[str, tuple[bytes | None, list[int] | None, int]] = {}
        """Each request's state load: (key, blocks, tokens); a None key or blocks fails it."""

    def _blocks(self, block_ids: Any) -> Any:
        """vLLM's block ids as the chunks see them (a Mamba hybrid's attention groups)."""
        return self.states.attention_blocks(block_ids) if self.states is not None else block_ids

    def _lookup_then(self, req_id: str, full: list[bytes]) -> Then | None:
        """Asynchronous lookups: each rank's lane also finds the longest stored state the
        rank's chunk hit allows, so the scheduler never waits on the daemon for it."""
        states, request = self.states, self._requests.get(req_id)
        if states is None or request is None:
            return None
        prompt_len = len(request.prompt_token_ids or [])
        ranks = [(t.raw_namespace, t.chunk_bytes) for t in self.state_transfers]

        def then(transfer: ChunkTransfer, rank: int, tiers: list[str]) -> int:
            namespace, state_bytes = ranks[rank]
            over = ChunkTransfer(transfer.client, namespace, state_bytes, codec="none")
            return states.hit(full, len(tiers), prompt_len, lambda key: over.lookup([key]) == 1)

        return then

    def _state_hit(self, request: Any, num_computed_tokens: int) -> int:
        """A Mamba hybrid's hit: only up to a stored state of exactly that length (:mod:`.states`).
        Asynchronous lookups found it on the lanes; where ranks disagree (tensor parallelism)
        or there was no such lookup, the scheduler asks the daemon here."""
        assert self.states is not None
        hit, root = self._hits.get(request.request_id), self._roots.get(request.request_id)
        if hit is None or root is None:
            return 0
        prompt = list(request.prompt_token_ids or [])
        full, _ = self.prompt_keys(prompt, root)

        def stored(key: bytes) -> bool:
            return all(t.lookup([key]) == 1 for t in self.state_transfers)

        answer = self.lookups.answer(request.request_id) if self.lookups is not None else None
        found = answer.then if answer is not None else []
        if found and all(isinstance(n, int) for n in found) and len(set(found)) == 1:
            n = int(found[0])
        else:
            self.stats["state_lookups_in_step"] += 1
            n = self.states.hit(full, hit.hit_chunks, len(prompt), stored)
        hit.hit_chunks = n // self.chunk_size  # never the tail: no state ends there
        hit.tiers = hit.tiers[: hit.hit_chunks]
        hit.state_tokens = n
        return max(0, n - num_computed_tokens)

    def _emit_state_saves(self, meta: LMCacheServerConnectorMetadata, scheduler_output: Any) -> None:
        """Store the Mamba states vLLM hands off in this step at a full chunk's end (:mod:`.states`)."""
        assert self.states is not None
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offloads = getattr(block_state, "boundary_state_offloads", None) or {}
        if not self.save_enabled:
            return
        for req_id, entries in offloads.items():
            tracker = self._trackers.get(req_id)
            if tracker is None or self._params.get(req_id, DEFAULT).skip_save:
                continue
            meta.state_saves.extend(self.states.saves(req_id, entries, tracker.keys))
