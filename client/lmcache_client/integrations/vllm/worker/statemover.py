"""A worker's Mamba states in and out of the daemon (:mod:`..states` says what is
stored and when): the state a load ends with is written into its block once every
chunk is in; a save's state is copied out in its step and stored then or later.

Primitive: :class:`StateMover`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ...transfer import ChunkTransfer
from ..mamba import BoundState
from ..states import StateSave

logger = logging.getLogger(__name__)


class StateMover:
    """A worker's Mamba states in and out of the daemon (one transfer per client: per thread)."""

    def __init__(self, bound: BoundState, namespace: str):
        self.bound = bound
        self.namespace = namespace
        self._transfers: dict[int, ChunkTransfer] = {}

    def _transfer(self, over: ChunkTransfer) -> ChunkTransfer:
        out = self._transfers.get(id(over.client))
        if out is None:
            out = ChunkTransfer(over.client, self.namespace, self.bound.layout.state_bytes, codec="none")
            self._transfers[id(over.client)] = out
        return out

    def load(self, request: Any, over: ChunkTransfer, covered: int) -> int:
        """Write the state a load ends with (``request.state_tokens``, its ``end_token``) into
        its blocks once ``covered`` reaches it; the bytes read, 0 when nothing was written."""
        blocks, key = request.state_blocks, request.state_key
        if key is None or not blocks or request.state_tokens != request.end_token or covered < request.end_token:
            return 0
        done = [0]

        def scatter(_: int, view: memoryview) -> None:
            self.bound.scatter(blocks, view)
            done[0] = view.nbytes

        if not self._transfer(over).get_one_with(key, self.bound.layout.state_bytes, scatter):
            return 0
        return done[0]

    def save(self, saves: Sequence[StateSave], over: ChunkTransfer) -> int:
        """Gather and store each state now; returns states stored.  Never raises."""
        return self.store(self.gather(saves), over)

    def gather(self, saves: Sequence[StateSave]) -> list[tuple[StateSave, bytearray]]:
        """Copy each state out of its blocks now (vLLM may hand them out from the next
        step on); the copies :meth:`store` stores, later and on any thread.  Never raises."""
        out = []
        for save in saves:
            try:
                out.append((save, self.bound.gather(save.blocks)))
            except Exception:
                logger.exception("copying the Mamba state of request %s failed", save.req_id)
        return out

    def store(self, gathered: Sequence[tuple[StateSave, bytearray]], over: ChunkTransfer) -> int:
        """Store states :meth:`gather` copied out; returns states stored.  Never raises."""
        stored = 0
        transfer = self._transfer(over)
        for save, payload in gathered:
            try:

                def fill(_: int, view: memoryview, payload: bytearray = payload) -> None:
                    view[:] = payload

                stored += transfer.put_one_with(save.key, len(payload), fill)
            except Exception:
                logger.exception("saving the Mamba state of request %s failed", save.req_id)
        return stored
