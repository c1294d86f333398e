"""The connector's KV events in vLLM's own event stream (``--kv-events-config``).

Each step vLLM's scheduler publishes its KV cache manager's events, then the
connector's ``take_events()``.  Through it the connector says what its
replica can load from the daemon: a ``BlockStored`` with vLLM's own block
hashes for the request (so a router indexing this replica's stream chains
them to the replica's GPU blocks), ``medium`` ``"CPU"`` (vLLM's MEDIUM_CPU:
the node's daemon, not the GPU), for the blocks of every full chunk the
connector has its workers store and of every chunk it loads.  Each block hash
is announced once (the last ``remember`` are remembered).  The connector
never learns when the daemon drops a chunk, so it announces no removals: the
daemon's own events (docs/events.md) say when a chunk leaves the node.

Primitive: :class:`ConnectorEvents` (``chunks``, ``take``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

MEDIUM = "CPU"
DEFAULT_REMEMBER = 1 << 20


class ConnectorEvents:
    def __init__(self, block_size: int, chunk_size: int, remember: int = DEFAULT_REMEMBER):
        if chunk_size % block_size:
            raise ValueError(f"chunk_size {chunk_size} is not a multiple of the block size {block_size}")
        self.block_size = block_size
        self.blocks_per_chunk = chunk_size // block_size
        self.remember = remember
        self._pending: list[Any] = []
        self._announced: OrderedDict[Any, None] = OrderedDict()

    def chunks(self, request: Any, first: int, end: int, prompt: Sequence[int]) -> None:
        """Announce the blocks of full chunks ``first .. end - 1`` of ``request``
        (whose prompt is ``prompt``), those vLLM has a block hash for."""
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        hashes = list(getattr(request, "block_hashes", None) or [])
        lo, hi = first * self.blocks_per_chunk, min(end * self.blocks_per_chunk, len(hashes))
        new = [j for j in range(lo, hi) if hashes[j] not in self._announced]
        if not new:
            return
        start = new[0]
        if new != list(range(start, hi)):  # a hole: announce the run after the last known block
            start = max(j for j in range(lo, hi) if hashes[j] in self._announced) + 1
            new = list(range(start, hi))
            if not new:
                return
        for j in new:
            self._announced[hashes[j]] = None
        while len(self._announced) > self.remember:
            self._announced.popitem(last=False)
        bs = self.block_size
        lora = getattr(request, "lora_request", None)
        self._pending.append(
            BlockStored(
                block_hashes=[maybe_convert_block_hash(hashes[j]) for j in new],
                parent_block_hash=maybe_convert_block_hash(hashes[start - 1]) if start else None,
                token_ids=list(prompt[start * bs : hi * bs]),
                block_size=bs,
                lora_id=lora.adapter_id if lora is not None else None,
                medium=MEDIUM,
                lora_name=lora.name if lora is not None else None,
            )
        )

    def take(self) -> list[Any]:
        """The events since the last call."""
        out, self._pending = self._pending, []
        return out
