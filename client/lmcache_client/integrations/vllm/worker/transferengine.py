"""The worker's asynchronous transfers: loads and saves off vLLM's thread.

With ``async_transfers`` (the default) the worker connector never waits on
the daemon inside vLLM's step:

- ``start_load_kv`` (vLLM calls it after the forward pass when no load is
  synchronous) submits each load to the *load lane*; the request waits in
  vLLM's ``WAITING_FOR_REMOTE_KVS`` meanwhile, its blocks allocated and
  untouched by any forward pass.  :meth:`TransferEngine.finished` reports it
  in ``finished_recving`` once its chunks are in its blocks; the blocks it
  could not fill go to ``get_block_ids_with_load_errors`` in the same step,
  so vLLM recomputes exactly those.  A load that misses its deadline
  (``load_deadline_ms``) keeps what arrived in time.
- ``wait_for_save`` submits each save to the *save lane* and returns.  The
  blocks a save reads stay valid while it runs: the scheduler connector
  answers ``request_finished`` with ``delay_free=True`` for a request with
  saves, and lists it to the workers (``meta.delayed``); the worker reports it
  in ``finished_sending`` once its saves are done, and only then does vLLM
  free its blocks.  A preemption frees blocks at once, so
  ``handle_preemptions`` waits for the saves already queued before the step's
  forward pass may overwrite them.
- A slow or absent daemon: each lane's calls time out (``timeout_s``) and
  fail open like the synchronous ones; saves beyond ``max_queued_saves`` are
  dropped (counted), so blocks are never held behind an unbounded backlog.

Primitive: :class:`TransferEngine`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any

from ..lanes import Lane
from ..meta import LoadRequest, SaveRequest
from ..states import StateSave
from .layerwise import Staged
from .workerside import WorkerSide
from .workerstats import LoadResult

logger = logging.getLogger(__name__)


def _stream_event(worker: WorkerSide) -> Any:
    """On a CUDA cache: an event recorded on the submitting thread's current stream (vLLM's
    compute), which a lane's copies wait for; None on a CPU cache."""
    engine = worker.engine
    if engine is None or engine.copier.device.type != "cuda":
        return None
    import torch

    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return event


def _after(event: Any) -> None:
    """Order the lane thread's stream after ``event`` (the forward pass that wrote, or will
    next read, the blocks)."""
    if event is not None:
        import torch

        torch.cuda.current_stream().wait_event(event)


def _inference_enabled() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - the worker always has torch
        return False
    return bool(torch.is_inference_mode_enabled())


@dataclasses.dataclass
class _Load:
    request: LoadRequest
    future: concurrent.futures.Future[LoadResult]


class TransferEngine:
    """A worker's load lane and save lane, and what is in flight on them."""

    IDLE_WAIT_S = 0.01
    """When vLLM has nothing to compute, :meth:`finished` waits this long for a load
    to complete instead of letting the engine loop spin through empty steps."""

    def __init__(
        self,
        worker: WorkerSide,
        load_lane: Lane,
        save_lane: Lane,
        *,
        load_deadline_s: float = 0.0,
        max_queued_saves: int = 256,
    ):
        self.worker = worker
        self.load_lane = load_lane
        self.save_lane = save_lane
        self.load_deadline_s = load_deadline_s
        """0: no deadline; a load uses what it got by then, the rest is recomputed."""
        self.max_queued_saves = max_queued_saves
        self._loads: dict[str, list[_Load]] = {}
        self._saves: dict[str, list[tuple[SaveRequest, concurrent.futures.Future[tuple[int, float]]]]] = {}
        self._delayed: set[str] = set()
        """Requests whose blocks vLLM holds until their saves are reported done."""
        self._state_saves: list[concurrent.futures.Future[int]] = []
        """Mamba states copied out in their step, stored on the save lane (:mod:`.states`)."""

    # -- loads ---------------------------------------------------------------------------
    def load(self, loads: Iterable[LoadRequest], deadlines: dict[str, float] | None = None) -> None:
        """Queue ``loads``; ``deadlines``: per-request seconds that override the default."""
        inference = _inference_enabled()
        worker = self.worker
        event = _stream_event(worker)
        for request in loads:
            limit = (deadlines or {}).get(request.req_id, self.load_deadline_s)
            deadline = time.monotonic() + limit if limit > 0 else None

            def job(
                transfer: Any, request: LoadRequest = request, deadline: float | None = deadline, event: Any = event
            ) -> LoadResult:
                if worker.asleep:  # sleep mode: the caches are unmapped, nothing may touch them
                    return LoadResult(request.start_token)
                _after(event)
                return worker.load_one(request, transfer, deadline)

            future = self.load_lane.submit(job, LoadResult(request.start_token), inference=inference)
            self._loads.setdefault(request.req_id, []).append(_Load(request, future))

    # -- saves ---------------------------------------------------------------------------
    def save(self, saves: list[SaveRequest], staged: list[Staged | None] | None = None) -> None:
        """Queue ``saves``; ``staged``: their layer-wise copies (:mod:`.layerwise`), aligned."""
        inference = _inference_enabled()
        worker = self.worker
        event = _stream_event(worker)
        for i, request in enumerate(saves):
            copied = staged[i] if staged else None
            if self.save_lane.pending >= self.max_queued_saves:
                worker.stats.saves_dropped += 1
                if copied is not None:
                    copied.wait()
                    copied.release()
                continue

            def job(
                transfer: Any, request: SaveRequest = request, event: Any = event, copied: Staged | None = copied
            ) -> tuple[int, float]:
                if worker.asleep:  # pragma: no cover - vLLM schedules nothing while asleep
                    return 0, 0.0
                _after(event)  # the forward pass that wrote these blocks comes first
                return worker.save_one(request, transfer, copied)

            future = self.save_lane.submit(job, (0, 0.0), inference=inference)
            self._saves.setdefault(request.req_id, []).append((request, future))

    def save_states(self, saves: list[StateSave]) -> None:
        """Copy the step's Mamba states out of their blocks now (vLLM may hand the blocks
        out from the next step on) and store them on the save lane."""
        worker = self.worker
        mover = worker.state_mover
        if mover is None or not worker.stores or worker.asleep or not saves:
            return
        gathered = mover.gather(saves)
        if not gathered:
            return
        if self.save_lane.pending >= self.max_queued_saves:
            worker.stats.saves_dropped += 1
            return
        self._state_saves.append(self.save_lane.submit(lambda transfer: mover.store(gathered, transfer), 0))

    def flush_saves(self, req_ids: Iterable[str] | None = None) -> None:
        """Wait until the saves of ``req_ids`` (None: every save) queued so far are done:
        their blocks are about to be handed out again.  No timeout: each daemon call
        is bounded by the client's ``timeout_s`` and a daemon that is down fails fast
        (the breaker), while a save still reading a block the forward pass rewrites
        would store wrong bytes."""
        started = time.monotonic()
        if req_ids is None:
            self.save_lane.drain()
        else:
            futures = [f for req_id in req_ids for _, f in self._saves.get(req_id, ())]
            if not futures:
                return
            concurrent.futures.wait(futures)
        waited = time.monotonic() - started
        if waited > 1.0:
            logger.warning("waited %.1f s for saves before their blocks were handed out again", waited)

    # -- get_finished --------------------------------------------------------------------
    def finished(self, delayed: Iterable[str] = (), *, idle: bool = False) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving) since the last call.  ``delayed``: requests
        the scheduler now holds blocks for until their saves are done.  ``idle``: the
        step computed nothing, so wait a little for a load to complete."""
        self._delayed.update(delayed)
        if idle:
            futures: list[concurrent.futures.Future[Any]] = [f.future for loads in self._loads.values() for f in loads]
            futures += [f for req_id in self._delayed for _, f in self._saves.get(req_id, ())]
            if futures:
                concurrent.futures.wait(futures, self.IDLE_WAIT_S, concurrent.futures.FIRST_COMPLETED)
        recving: set[str] = set()
        for req_id, loads in list(self._loads.items()):
            if all(load.future.done() for load in loads):
                for load in loads:
                    self.worker.finish_load(load.request, load.future.result())
                del self._loads[req_id]
                recving.add(req_id)
        for stored in [f for f in self._state_saves if f.done()]:
            self._state_saves.remove(stored)
            self.worker.stats.stored_states += stored.result()
        sending: set[str] = set()
        for req_id, saves in list(self._saves.items()):
            if all(future.done() for _, future in saves):
                for request, future in saves:
                    self.worker.finish_save(request, *future.result())
                del self._saves[req_id]
        for req_id in list(self._delayed):
            if req_id not in self._saves:
                self._delayed.discard(req_id)
                sending.add(req_id)
        return sending, recving

    @property
    def in_flight(self) -> tuple[int, int]:
        """(requests loading, requests with saves running + Mamba state stores not yet counted)."""
        return len(self._loads), len(self._saves) + len(self._state_saves)

    def close(self) -> None:
        self.load_lane.close()
        self.save_lane.close()
