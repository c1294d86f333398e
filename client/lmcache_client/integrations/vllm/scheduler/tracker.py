"""The scheduler side's record of one scheduled request (:class:`Tracker`).

Its chunk keys, its blocks (every KV cache group's, when vLLM keeps several:
:mod:`..groups`) and how much of it the daemon holds, followed across chunked
prefill and preemption by :class:`~.side.SchedulerSide`.

Primitive: :class:`Tracker`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..groups import split_groups


@dataclasses.dataclass
class Tracker:
    """One scheduled request: its chunk keys and blocks, and what of it is stored."""

    keys: list[bytes]
    """Keys of every full chunk of the prompt (and, with ``save_decode_cache``, of the
    generated tokens' full chunks computed so far)."""
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
    group_ids: list[list[int]] | None = None
    """Several KV cache groups: each group's blocks (``block_ids`` is the first's)."""
    unsavable: bool = False
    """A sliding-window group lost a chunk's blocks before it was stored: no more saves."""

    def set_blocks(self, block_ids: Any, extend: bool = False) -> None:
        """Take vLLM's block ids (a tuple of per-group lists) as the blocks or, with
        ``extend``, as new blocks appended to them."""
        groups = split_groups(block_ids)
        if not extend or self.group_ids is None:
            self.group_ids = [[] for _ in groups] if len(groups) > 1 else None
            if not extend:
                self.block_ids = []
        self.block_ids.extend(groups[0] if groups else [])
        if self.group_ids is not None:
            for have, new in zip(self.group_ids, groups):
                have.extend(new)

    def groups_copy(self) -> list[list[int]] | None:
        """Each group's blocks, copied for the metadata (None: one group)."""
        return [list(ids) for ids in self.group_ids] if self.group_ids is not None else None
