"""The worker's loads (``start_load_kv``, or a load lane): chunks into vLLM's blocks.

Each load's chunks are scattered into the request's blocks for every layer,
straight out of the daemon's pool slots where it shares them (one copy),
through payload frames otherwise: chunk by chunk, or one batched copy per
daemon batch (``batch_copies``; the batch's ``flush`` runs before its leases
end).  Only a leading run of valid chunks is used; the blocks of tokens that
could not be loaded (a miss, a chunk of the wrong size, the daemon down, a
lease that lapsed mid-copy, a deadline) are reported as failed so vLLM
recomputes them: a failed load costs a recompute, never garbage.  With
several KV cache groups (or Mamba states) failures are reported per request.

Primitive: :class:`Loads`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ...paged import blocks_covering
from ...transfer import ChunkTransfer
from ..meta import LoadRequest
from .chunkcopies import CacheCopies
from .payloads import Payloads
from .statemover import StateMover
from .workerstats import LoadResult, WorkerStats

logger = logging.getLogger(__name__)


def _torch() -> Any:
    import torch

    return torch


class Loads:
    """A worker's loads, and the blocks (or requests) whose loads failed since last asked.
    ``per_request``: failures are reported per request (several KV cache groups, states)."""

    def __init__(
        self,
        copies: CacheCopies,
        payloads: Payloads,
        stats: WorkerStats,
        mover: StateMover | None,
        *,
        per_request: bool,
    ):
        self.copies = copies
        self.payloads = payloads
        self.stats = stats
        self.mover = mover
        self.per_request = per_request
        self._failed: set[int] = set()
        self._failed_requests: set[str] = set()

    def load_one(self, request: LoadRequest, transfer: ChunkTransfer, deadline: float | None = None) -> LoadResult:
        """Scatter what can be loaded of ``request`` through ``transfer``; never raises.
        ``deadline`` (monotonic seconds): chunks that arrive later are not used."""
        started = time.perf_counter()
        result = LoadResult(request.start_token)
        try:
            result.end = self._load_one(request, transfer, result, deadline)
        except Exception:  # a bug or a device error: recompute, do not crash the engine
            logger.exception("loading KV for request %s failed", request.req_id)
            result.end = request.start_token
        result.seconds = time.perf_counter() - started
        return result

    def finish(self, request: LoadRequest, result: LoadResult) -> None:
        """Count a finished load; the blocks it did not fill are reported as failed."""
        self.stats.load_s += result.seconds
        self.stats.loaded_bytes += result.nbytes
        self.stats.loaded_tokens += result.end - request.start_token
        if result.late:
            self.stats.load_deadline_missed += 1
        if result.end < request.end_token:
            failed = blocks_covering(request.block_ids, result.end, request.end_token, self.copies.engine.block_size)
            if self.per_request:  # vLLM 0.32: per request with several groups
                self._failed_requests.add(request.req_id)
            else:
                self._failed.update(failed)
            self.stats.load_failed_tokens += request.end_token - result.end
            logger.warning(
                "request %s: %d of %d tokens loaded%s; %s",
                request.req_id,
                result.end - request.start_token,
                request.end_token - request.start_token,
                " by its deadline" if result.late else "",
                "the request is recomputed" if self.per_request else f"{len(failed)} blocks to recompute",
            )

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def take_failed_requests(self) -> set[str]:
        failed, self._failed_requests = self._failed_requests, set()
        return failed

    def _load_one(
        self, request: LoadRequest, transfer: ChunkTransfer, result: LoadResult, deadline: float | None
    ) -> int:
        """Scatter what can be loaded; returns the end of the tokens written."""
        chunk = self.payloads.layout.chunk_size
        base = request.first_chunk * chunk
        slots = self.copies.slots(request.block_ids, request.group_block_ids, request.start_token, request.end_token)
        copies = self.copies.copies(slots)
        used = [0]  # leading chunks scattered before the deadline
        tail = False

        def scatter(i: int, view: memoryview) -> None:
            if deadline is not None and (result.late or time.monotonic() > deadline):
                result.late = True
                return
            c0 = base + i * chunk
            lo, hi = max(c0, request.start_token), min(c0 + chunk, request.end_token)
            part = slice(lo - request.start_token, hi - request.start_token)
            # batched: copied at flush, which get_prefix_with calls while the views are leased
            copies.scatter(part, self.payloads.of(view, lo - c0, hi - c0))
            result.nbytes += view.nbytes
            used[0] = i + 1

        loaded = transfer.get_prefix_with(request.keys, scatter, flush=copies.flush) if request.keys else 0
        loaded = min(loaded, used[0])
        covered = base + loaded * chunk
        if request.tail_key is not None and loaded == len(request.keys) and not result.late:
            t0, n = covered, request.tail_tokens
            lo, hi = max(t0, request.start_token), min(t0 + n, request.end_token)

            def scatter_tail(_: int, view: memoryview) -> None:
                part = slice(lo - request.start_token, hi - request.start_token)
                slots[part].scatter(self.payloads.of(view, lo - t0, hi - t0, tokens=n))
                result.nbytes += view.nbytes

            if hi > lo and transfer.get_one_with(request.tail_key, self.payloads.tail_bytes(n), scatter_tail):
                covered = t0 + n
                tail = True  # copied chunk by chunk on this thread's stream
        cuda = self.copies.engine.copier.device.type == "cuda"
        if cuda and (not copies.batched or tail):  # else each batch's event was waited
            _torch().cuda.current_stream().synchronize()
        if request.state_tokens and not self._load_state(request, transfer, covered, result):
            return request.start_token  # no state of exactly this length: the request is recomputed
        return max(request.start_token, min(request.end_token, covered))

    def _load_state(self, request: LoadRequest, transfer: ChunkTransfer, covered: int, result: LoadResult) -> bool:
        """Write the request's Mamba state once every chunk up to it is in (:mod:`.statemover`)."""
        if self.mover is None or result.late:
            return False
        nbytes = self.mover.load(request, transfer, covered)
        result.nbytes += nbytes
        return nbytes > 0
