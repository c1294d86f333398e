"""The worker's saves (``wait_for_save``, ``save_kv_layer``): a part of
:class:`~.workerside.WorkerSide`.

Each save's chunks are gathered from vLLM's KV cache straight into reserved
pool slots and committed: chunk by chunk, in one batched copy per daemon
batch (``batch_copies``; the batch's ``flush`` runs before the commit), or from
the host staging a layer-wise save filled during the forward pass
(:mod:`.layerwise`).  A failed save is a future miss, never an engine failure.

Primitive: :class:`Saves`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ...transfer import ChunkTransfer
from ..meta import SaveRequest
from .chunkcopies import CacheCopies
from .layerwise import LayerwiseSaver, Staged
from .payloads import Payloads
from .workerstats import WorkerStats

logger = logging.getLogger(__name__)


class Saves:
    """A worker's saves.  ``stores``: False on the ranks that load but never store
    (MLA: rank 0 stores for all); ``layerwise``: the layer-wise saver, if on."""

    def __init__(
        self,
        copies: CacheCopies,
        payloads: Payloads,
        stats: WorkerStats,
        layerwise: LayerwiseSaver | None,
        *,
        stores: bool,
    ):
        self.copies = copies
        self.payloads = payloads
        self.stats = stats
        self.layerwise = layerwise
        self.stores = stores

    # -- save_kv_layer ---------------------------------------------------------------
    def save_layer(self, step: Any, saves: list[SaveRequest], layer_name: str) -> None:
        """Copy layer ``layer_name`` of the step's saves out now (``layerwise_save``)."""
        if self.layerwise is not None and saves and self.stores:
            self.layerwise.layer(
                step, saves, lambda lo, hi, r: self.copies.paged_slots(r.block_ids, lo, hi), layer_name
            )

    def take_staged(self, step: Any, saves: list[SaveRequest]) -> list[Staged | None] | None:
        """The step's layer-wise copies, aligned with ``saves`` (None: no layer-wise save)."""
        if self.layerwise is None or not saves:
            return None
        staged = self.layerwise.end(step) or [None] * len(saves)
        self.stats.layerwise_saves += sum(s is not None for s in staged)
        self.stats.layerwise_fallbacks += sum(s is None for s in staged) if self.stores else 0
        return staged

    # -- wait_for_save ---------------------------------------------------------------
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
        chunk = self.payloads.layout.chunk_size
        started = time.perf_counter()
        start = request.first_chunk * chunk
        if staged is not None and not staged.wait():  # logged; gathered from the cache instead
            staged.release()
            staged = None
        try:
            end = start + len(request.keys) * chunk
            slots = self.copies.slots(request.block_ids, request.group_block_ids, start, end)
            if not slots.complete():  # never store what is not there
                logger.warning("request %s: a sliding window freed blocks of its chunks, not stored", request.req_id)
                return 0, time.perf_counter() - started
            copies = self.copies.copies(slots, batched=staged is None)

            def gather(i: int, view: memoryview) -> None:
                if staged is not None:
                    self.payloads.of(view).copy_(staged.chunk(i, chunk))
                    return
                # batched: copied at flush, which put_with calls before the batch's commit
                copies.gather(slice(i * chunk, (i + 1) * chunk), self.payloads.of(view))

            done = transfer.put_with(request.keys, gather, request.tokens, flush=copies.flush) if request.keys else 0
            if request.tail_key is not None and done == len(request.keys):
                done += self._save_tail(request, transfer, staged)
        except Exception:
            logger.exception("saving KV chunks of request %s failed", request.req_id)
            done = 0
        finally:
            if staged is not None:
                staged.release()
        return done, time.perf_counter() - started

    def finish(self, request: SaveRequest, done: int, seconds: float) -> None:
        """Count a finished save."""
        self.stats.stored_chunks += done
        self.stats.stored_bytes += min(done, len(request.keys)) * self.payloads.layout.nbytes
        if done > len(request.keys):
            self.stats.stored_bytes += self.payloads.tail_bytes(request.tail_tokens)
        self.stats.store_s += seconds

    def _save_tail(self, request: SaveRequest, transfer: ChunkTransfer, staged: Staged | None = None) -> int:
        """Gather (or take from ``staged``) and store a request's tail; 1 when it is stored."""
        n = request.tail_tokens
        slots = self.copies.slots(
            request.block_ids, request.group_block_ids, request.tail_start, request.tail_start + n
        )
        if not slots.complete():
            return 0

        def gather(_: int, view: memoryview) -> None:
            if staged is not None:
                self.payloads.of(view, tokens=n).copy_(staged.tail_tokens())
                return
            slots.gather(self.payloads.of(view, tokens=n))

        assert request.tail_key is not None
        return int(transfer.put_one_with(request.tail_key, self.payloads.tail_bytes(n), gather))
