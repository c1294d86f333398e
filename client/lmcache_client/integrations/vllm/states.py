"""Mamba / GDN states through the vLLM connector: which groups hold what, and the state hits.

A hybrid model (Qwen3-Next: gated-delta-net layers and full-attention layers)
has, under vLLM's hybrid KV cache manager in ``align`` mode, one KV cache
group per Mamba layer (:class:`~.mamba.StateLayout`) besides its attention
groups.  The connector moves the attention groups' K/V as chunks, as for any
model, and a Mamba state on the side (:mod:`.mamba`):

- **Saves**: vLLM hands the connector each committed boundary state with its
  exact block (``scheduler_output.kv_connector_block_state.boundary_state_offloads``:
  ``{request: [(group, block, boundary_tokens)]}``).  A state is stored when
  its boundary ``n`` ends a full chunk of the prompt, under
  ``state_key(prompt, n)``; the worker copies it out in the step that offered
  it (``wait_for_save``), before vLLM may hand the block out again.
- **Lookups**: a hit is the longest ``n`` that is a multiple of vLLM's block
  size and of the chunk size, at most the chunks found, below the prompt's
  length, and whose state is stored: anything else is a miss.
- **Loads**: vLLM gives a hit of ``n`` tokens a fresh block at slot
  ``n / block_size - 1`` of each Mamba group; the worker writes the state
  there once every chunk is in, else the request is recomputed (a load of
  another length than ``n`` is refused: a state is only right at its own).

Primitives: :class:`StateWiring` (both sides), :class:`StateSave`; the worker's copies:
:class:`~.worker.statemover.StateMover`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import types
from collections.abc import Callable, Sequence
from typing import Any

from .mamba import NULL_BLOCK_ID, StateLayout, state_key_after, state_slot

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StateSave:
    """Store the state after ``tokens`` tokens of a request, in ``blocks`` (one per Mamba group)."""

    req_id: str
    key: bytes
    tokens: int
    blocks: list[int]


class StateWiring:
    """Where a hybrid model's attention groups and Mamba groups sit in vLLM's group order."""

    def __init__(self, layout: StateLayout, kv_cache_config: Any, chunk_size: int):
        self.layout = layout
        self.chunk_size = chunk_size
        state_ids = {g.group_id for g in layout.groups}
        groups = list(kv_cache_config.kv_cache_groups)
        self.attention_ids = [i for i in range(len(groups)) if i not in state_ids]
        """vLLM's indices of the groups that hold per-token K/V."""
        self.state_ids = [g.group_id for g in layout.groups]
        """vLLM's indices of the Mamba groups, in the payload's order."""
        if not self.attention_ids:
            raise ValueError("a model with Mamba groups only: no chunks to key its states by")
        self.block_size = layout.block_size
        self.step = math.lcm(self.block_size, chunk_size)
        """A state hit's length is a multiple of this (whole blocks and whole chunks)."""
        self.attention_config = types.SimpleNamespace(
            kv_cache_groups=[groups[i] for i in self.attention_ids],
            num_blocks=getattr(kv_cache_config, "num_blocks", None),
            kv_cache_tensors=getattr(kv_cache_config, "kv_cache_tensors", None),
        )
        """``kv_cache_config`` with the attention groups only (the chunks' side)."""
        self.attention_layers = {name for g in self.attention_config.kv_cache_groups for name in g.layer_names}

    # -- groups -----------------------------------------------------------------------
    def attention_blocks(self, block_ids: Any) -> Any:
        """vLLM's per-group block ids with the Mamba groups left out (a tuple of lists)."""
        if not block_ids or not isinstance(block_ids[0], list | tuple):
            return block_ids
        return tuple(block_ids[i] for i in self.attention_ids)

    def state_blocks(self, block_ids: Any, tokens: int) -> list[int] | None:
        """The block of each Mamba group that holds (or is to hold) the state after
        ``tokens`` tokens; None when a group has no real block there."""
        slot = state_slot(tokens, self.block_size)
        out: list[int] = []
        for gid in self.state_ids:
            ids = list(block_ids[gid]) if block_ids and gid < len(block_ids) else []
            if slot >= len(ids) or ids[slot] == NULL_BLOCK_ID:
                return None
            out.append(int(ids[slot]))
        return out

    def state_caches(self, kv_caches: dict[str, Any], vllm_config: Any) -> dict[str, Any]:
        """Each Mamba layer's state tensors (one per part).  ``register_kv_caches`` hands a
        Mamba layer its raw page tensor; the layer's own views (what its kernels write) are
        in vLLM's forward context."""
        context = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
        out: dict[str, Any] = {}
        for name in self.layout.layer_names:
            kv = kv_caches.get(name)
            if not isinstance(kv, list | tuple) and name in context:
                kv = context[name].kv_cache
            if isinstance(kv, list | tuple) and kv and isinstance(kv[0], list | tuple):
                kv = kv[0]  # one entry per virtual engine
            if kv is not None:
                out[name] = kv
        return out

    # -- keys ---------------------------------------------------------------------------
    def key(self, chunk_keys: Sequence[bytes], tokens: int) -> bytes:
        """The state key after ``tokens`` tokens, a whole number of chunks whose keys are ``chunk_keys``."""
        if tokens <= 0 or tokens % self.chunk_size or tokens // self.chunk_size > len(chunk_keys):
            raise ValueError(f"a state after {tokens} tokens is not at the end of a known chunk")
        return state_key_after(chunk_keys[tokens // self.chunk_size - 1], (), tokens)

    def load_plan(
        self, block_ids: Any, chunk_keys: Sequence[bytes], tokens: int, state_tokens: int
    ) -> tuple[bytes | None, list[int] | None, int]:
        """A load of ``tokens`` tokens for a hit found with a state after ``state_tokens``:
        (key, blocks, tokens).  A state is right at exactly its length: a load of another
        (vLLM cut it) or without a real block per Mamba group gets no key, and fails."""
        if tokens != state_tokens or tokens <= 0:
            return None, None, tokens
        blocks = self.state_blocks(block_ids, tokens)
        return (self.key(chunk_keys, tokens) if blocks is not None else None), blocks, tokens

    def saves(self, req_id: str, offloads: Sequence[Any], chunk_keys: Sequence[bytes]) -> list[StateSave]:
        """The states to store of vLLM's hand-offs for one request: every boundary that
        ends a known chunk and that every Mamba group handed off."""
        by_tokens: dict[int, dict[int, int]] = {}
        for group, block, tokens in offloads:
            by_tokens.setdefault(int(tokens), {})[int(group)] = int(block)
        out: list[StateSave] = []
        for tokens, blocks in sorted(by_tokens.items()):
            if tokens <= 0 or tokens % self.chunk_size or tokens // self.chunk_size > len(chunk_keys):
                continue
            if any(blocks.get(gid, NULL_BLOCK_ID) == NULL_BLOCK_ID for gid in self.state_ids):
                continue
            out.append(StateSave(req_id, self.key(chunk_keys, tokens), tokens, [blocks[g] for g in self.state_ids]))
        return out

    def hit(
        self, chunk_keys: Sequence[bytes], hit_chunks: int, prompt_len: int, stored: Callable[[bytes], bool]
    ) -> int:
        """The longest prefix whose chunks (``hit_chunks`` leading ones found) and state
        are stored; 0 when none.  ``stored(key)`` asks the daemon for one state key."""
        most = min(hit_chunks, len(chunk_keys)) * self.chunk_size
        n = min(most, prompt_len - 1) // self.step * self.step
        while n > 0:
            if stored(self.key(chunk_keys, n)):
                return n
            n -= self.step
        return 0
