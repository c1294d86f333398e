"""Lanes: the threads that talk to the daemon for the asynchronous vLLM connector.

A :class:`Lane` is one daemon thread with its own FIFO of jobs and its own
:class:`~..transfer.ChunkTransfer` (so its own client socket: a client is
not thread-safe).  vLLM's threads only enqueue jobs and read results; every
daemon round trip and every copy in or out of a KV cache runs on a lane.
The scheduler asks through one lane per tensor-parallel rank
(:mod:`.scheduler.lookups`), a worker loads on one lane and saves on another
(:mod:`.worker.transferengine`), so a backlog of saves never delays a load.

A job that raises is logged and yields its ``fallback``: a broken daemon or
a bug costs a miss, never a dead lane or a dead engine.

Primitive: :class:`Lane`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _inference_mode(enabled: bool) -> Any:
    """torch's inference mode as the submitting thread had it (vLLM runs its model,
    and so creates the caches a lane copies into, under ``torch.inference_mode``;
    an in-place write to such a tensor from outside that mode is refused)."""
    if not enabled:
        return contextlib.nullcontext()
    import torch

    return torch.inference_mode()


class Lane:
    """One thread, one queue, one ``transfer``; jobs run in the order submitted."""

    def __init__(self, name: str, transfer: Any):
        self.name = name
        self.transfer = transfer
        self._jobs: queue.SimpleQueue[tuple[Callable[[Any], Any], Any, bool, concurrent.futures.Future[Any]] | None]
        self._jobs = queue.SimpleQueue()
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Jobs submitted and not finished."""
        return self._pending

    def submit(self, job: Callable[[Any], T], fallback: T, *, inference: bool = False) -> concurrent.futures.Future[T]:
        """Run ``job(transfer)`` on the lane; its future holds the result, or ``fallback``
        when the job raised (logged) or the lane was closed first."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                future.set_result(fallback)
                return future
            self._pending += 1
        self._jobs.put((job, fallback, inference, future))
        return future

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every job submitted so far has finished; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Finish the queued jobs (up to ``timeout_s``), then stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._jobs.put(None)
        self._thread.join(timeout_s)
        close = getattr(getattr(self.transfer, "client", None), "close", None)
        if close is not None and not self._thread.is_alive():
            close()

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, fallback, inference, future = item
            try:
                with _inference_mode(inference):
                    result = job(self.transfer)
            except Exception:  # a bug or a device error: a miss, never a dead lane
                logger.exception("%s: a job failed", self.name)
                result = fallback
            future.set_result(result)
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()
