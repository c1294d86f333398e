"""The worker's saves (``wait_for_save``, ``save_kv_layer``): a base of
:class:`~.worker.WorkerSide`.

Each save's chunks are gathered from vLLM's KV cache straight into reserved
pool slots and committed: chunk by chunk, in one batched copy per daemon
batch (``batch_copies``; the fill's ``flush`` runs before the commit), or from
the host staging a layer-wise save filled during the forward pass
(:mod:`.layerwise`).  A failed save is a future miss, never an engine failure.

Primitive: :class:`Saves`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..batched import BatchedCopies, Part
from ..layout import ChunkLayout
from ..paged import Slots
from ..transfer import ChunkTransfer
from .groups import GroupSlots
from .layerwise import LayerwiseSaver, Staged
from .meta import SaveRequest
from .workerstats import WorkerStats

logger = logging.getLogger(__name__)


class Saves:
    """The save path of a worker (:class:`~.worker.WorkerSide` holds the state)."""

    transfer: ChunkTransfer
    layout: ChunkLayout
    stats: WorkerStats
    stores: bool
    asleep: bool
    batched: BatchedCopies | None
    layerwise: LayerwiseSaver | None

    def _slots(self, block_ids: list[int], group_block_ids: Any, start: int, end: int) -> Slots | GroupSlots:
        raise NotImplementedError

    def _payload(self, view: memoryview, lo: int = 0, hi: int | None = None, *, tokens: int | None = None) -> Any:
        raise NotImplementedError

    def _gather(self, slots: Slots | GroupSlots, payload: Any) -> None:
        raise NotImplementedError

    def tail_bytes(self, tokens: int) -> int:
        raise NotImplementedError

    # -- save_kv_layer ---------------------------------------------------------------
    def save_layer(self, step: Any, saves: list[SaveRequest], layer_name: str) -> None:
        """Copy layer ``layer_name`` of the step's saves out now (``layerwise_save``)."""
        if self.layerwise is not None and saves and self.stores and not self.asleep:
            self.layerwise.layer(step, saves, lambda lo, hi, r: self._slots(r.block_ids, None, lo, hi), layer_name)

    def take_staged(self, step: Any, saves: list[SaveRequest]) -> list[Staged | None] | None:
        """The step's layer-wise copies, aligned with ``saves`` (None: no layer-wise save)."""
        if self.layerwise is None or not saves:
            return None
        staged = self.layerwise.end(step) or [None] * len(saves)
        self.stats.layerwise_saves += sum(s is not None for s in staged)
        self.stats.layerwise_fallbacks += sum(s is None for s in staged) if self.stores else 0
        return staged

    # -- wait_for_save ---------------------------------------------------------------
    def save(self, saves: list[SaveRequest], staged: list[Staged | None] | None = None) -> int:
        """Gather and store every save of the step now (the synchronous mode); returns
        chunks stored.  ``staged``: saves already copied out layer by layer (:mod:`.layerwise`)."""
        if self.asleep:  # pragma: no cover - vLLM schedules nothing while asleep
            return 0
        stored = 0
        for i, request in enumerate(saves):
            done, seconds = self.save_one(request, self.transfer, staged[i] if staged else None)
            self.finish_save(request, done, seconds)
            stored += done
        return stored

    def save_one(
        self, request: SaveRequest, transfer: ChunkTransfer, staged: Staged | None = None
    ) -> tuple[int, float]:
        """Gather and store ``request`` through ``transfer``; (chunks stored, seconds).
        ``staged``: its tokens already copied out layer by layer (:mod:`.layerwise`; a
        copy that failed falls back to the gather).  Never raises: a failed save is a
        future miss, never an engine failure."""
        if not self.stores:
            if staged is not None:
                staged.release()
            return 0, 0.0
        chunk = self.layout.chunk_size
        started = time.perf_counter()
        start = request.first_chunk * chunk
        if staged is not None and not staged.wait():  # logged; gathered from the cache instead
            staged.release()
            staged = None
        try:
            end = start + len(request.keys) * chunk
            slots = self._slots(request.block_ids, request.group_block_ids, start, end)
            if isinstance(slots, GroupSlots) and not slots.complete():  # never store what is not there
                logger.warning("request %s: a sliding window freed blocks of its chunks, not stored", request.req_id)
                return 0, time.perf_counter() - started

            batched = self.batched if staged is None and isinstance(slots, Slots) else None
            pending: list[Part] = []

            def gather(i: int, view: memoryview) -> None:
                if staged is not None:
                    self._payload(view).copy_(staged.chunk(i, chunk))
                    return
                target = _part(slots, slice(i * chunk, (i + 1) * chunk))
                if batched is not None and isinstance(target, Slots):
                    pending.append(Part(target, self._payload(view)))  # copied at flush, before the commit
                else:
                    self._gather(target, self._payload(view))

            if batched is not None:
                copies = batched

                def flush() -> None:
                    """The batch's chunks in one go (put_with calls it before their commit)."""
                    if pending:
                        copies.gather(pending).wait()
                        pending.clear()

                gather.flush = flush  # type: ignore[attr-defined]

            done = transfer.put_with(request.keys, gather, request.tokens) if request.keys else 0
            if request.tail_key is not None and done == len(request.keys):
                done += self._save_tail(request, transfer, staged)
        except Exception:
            logger.exception("saving KV chunks of request %s failed", request.req_id)
            done = 0
        finally:
            if staged is not None:
                staged.release()
        return done, time.perf_counter() - started

    def finish_save(self, request: SaveRequest, done: int, seconds: float) -> None:
        """Count a finished save."""
        self.stats.stored_chunks += done
        self.stats.stored_bytes += min(done, len(request.keys)) * self.layout.nbytes
        if done > len(request.keys):
            self.stats.stored_bytes += self.tail_bytes(request.tail_tokens)
        self.stats.store_s += seconds

    def _save_tail(self, request: SaveRequest, transfer: ChunkTransfer, staged: Staged | None = None) -> int:
        """Gather (or take from ``staged``) and store a request's tail; 1 when it is stored."""
        n = request.tail_tokens
        slots = self._slots(request.block_ids, request.group_block_ids, request.tail_start, request.tail_start + n)
        if isinstance(slots, GroupSlots) and not slots.complete():
            return 0

        def gather(_: int, view: memoryview) -> None:
            if staged is not None:
                self._payload(view, tokens=n).copy_(staged.tail_tokens())
                return
            self._gather(slots, self._payload(view, tokens=n))

        assert request.tail_key is not None
        return int(transfer.put_one_with(request.tail_key, self.tail_bytes(n), gather))


def _part(slots: Slots | GroupSlots, part: slice) -> Slots | GroupSlots:
    """Tokens ``part`` of a range's slots."""
    if isinstance(slots, GroupSlots):
        return slots[part]
    return Slots(slots.blocks[part], slots.offsets[part])
