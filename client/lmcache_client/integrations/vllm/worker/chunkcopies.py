"""The worker's one copy mechanism: chunks in and out of vLLM's paged KV cache.

Loads and saves share it.  :class:`CacheCopies` (built at ``register_kv_caches``)
knows each KV-cache group's copier (one group: the engine's copier over every
layer, so one group and many are the same code), the batched copies of each
group (``batch_copies``; :mod:`...batched`) and where a request's tokens sit
(:class:`~..groups.GroupSlots`).  Per load or save it hands out a
:class:`ChunkCopies`: it takes the per-chunk copies of that token range and
runs them at once, or, batched, queues them until :meth:`ChunkCopies.flush`
(one copier call per group and daemon batch, made before the batch's leases
end or its commit).  The callback and its ``flush`` go to the transfer as two
arguments (``get_prefix_with(keys, use, flush=...)``).

Which tokens are copied is the same either way: every token of the range into
(out of) each full-attention group, and into a sliding-window group only the
tokens in its real blocks (a save of a range with null blocks is refused
before any copy).

Primitives: :class:`CacheCopies`, :class:`ChunkCopies`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ...batched import BatchedCopies, Part
from ...paged import Slots, token_slots
from ..enginelayout import EngineLayout
from ..groups import FULL, GroupCopier, GroupInfo, GroupSlots, group_slots


class ChunkCopies:
    """The copies of one load or save over one token range's slots: at once
    (``batches`` None), or queued per group until :meth:`flush`."""

    def __init__(self, slots: GroupSlots, batches: Sequence[BatchedCopies] | None):
        self.slots = slots
        self._batches = batches
        self._scatters: list[list[Part]] = [[] for _ in slots.parts]
        self._gathers: list[list[Part]] = [[] for _ in slots.parts]
        self._after: list[Callable[[], None]] = []

    @property
    def batched(self) -> bool:
        """Whether copies wait for :meth:`flush`."""
        return self._batches is not None

    def scatter(self, part: slice, payload: Any) -> None:
        """Write ``payload`` ``(layers, 2, tokens, heads, dim)`` into tokens ``part`` of the
        range: now, or at :meth:`flush` (``payload`` must stay valid until then)."""
        target = self.slots[part]
        if self._batches is None:
            target.scatter(payload)
            return
        for pending, p in zip(self._scatters, target.scatter_parts(payload)):
            if p is not None:
                pending.append(p)

    def gather(self, part: slice, payload: Any) -> None:
        """Read tokens ``part`` of the range into ``payload``: now, or at :meth:`flush`."""
        target = self.slots[part]
        if self._batches is None:
            target.gather(payload)
            return
        for pending, (p, after) in zip(self._gathers, target.gather_parts(payload)):
            pending.append(p)
            if after is not None:
                self._after.append(after)

    def flush(self) -> None:
        """Run the queued copies, one batch per group, and wait for them (on CUDA only for
        their batch's event, on this thread); nothing queued: nothing to do."""
        for batches, scatters, gathers in zip(self._batches or (), self._scatters, self._gathers):
            if scatters:
                batches.scatter(scatters).wait()
                scatters.clear()
            if gathers:
                batches.gather(gathers).wait()
                gathers.clear()
        for after in self._after:
            after()
        self._after.clear()


class CacheCopies:
    """vLLM's KV cache as the worker copies chunks in and out of it (after ``register``)."""

    def __init__(self, engine: EngineLayout, *, batched: bool):
        self.engine = engine
        whole = GroupInfo(FULL, engine.block_size, tuple(engine.layer_names))
        self.groups: list[GroupCopier] = engine.groups or [
            GroupCopier(whole, list(range(len(engine.layer_names))), engine.copier)
        ]
        """Each KV cache group's copier (one group: the engine's, over every layer)."""
        self.batches = [BatchedCopies(g.copier) for g in self.groups] if batched else None
        """Each group's batched copies (``batch_copies``); None: chunk by chunk."""

    def slots(self, block_ids: list[int], group_block_ids: Any, start: int, end: int) -> GroupSlots:
        """Where tokens ``[start, end)`` of a request sit, in each group (:mod:`..groups`)."""
        engine = self.engine
        if engine.groups:
            if group_block_ids is None:
                raise ValueError("several KV cache groups, but the request carries one group's blocks")
            return group_slots(engine.groups, group_block_ids, start, end, engine.block_size, engine.block_tokens)
        one = token_slots(block_ids, start, end, engine.block_size, engine.block_tokens)
        return GroupSlots([(self.groups[0], one, None)])

    def paged_slots(self, block_ids: list[int], start: int, end: int) -> Slots:
        """Tokens ``[start, end)`` of a one-group cache, as the engine copier takes them
        (layer-wise saves copy layer by layer through it)."""
        engine = self.engine
        if engine.groups:
            raise ValueError("several KV cache groups, but the request carries one group's blocks")
        return token_slots(block_ids, start, end, engine.block_size, engine.block_tokens)

    def copies(self, slots: GroupSlots, *, batched: bool = True) -> ChunkCopies:
        """The copies of one load or save over ``slots``; ``batched``: queued until flush
        where the cache batches its copies."""
        return ChunkCopies(slots, self.batches if batched else None)

    @property
    def launches(self) -> int:
        """Batched copier calls made so far (one per group and daemon batch)."""
        return sum(b.launches for b in self.batches or ())
