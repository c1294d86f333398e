"""Asynchronous lookups for the scheduler connector: vLLM's scheduler never waits on the daemon.

``get_num_new_matched_tokens`` asks :meth:`LookupService.ask` and answers
vLLM ``None`` ("ask again next step") until the answer is in; the answer is
kept per request, so a request that waits for blocks is not asked again
every step.  Under tensor parallelism each rank's namespace is asked on a
lane of its own, all at once, and the shortest answer counts.  With
``prefetch`` the daemon also promotes the hit chunks it holds on disk or in
Redis into memory while the request waits for its load, and a request that
ends before its load (finished or aborted while its lookup was out or while
it waited for blocks) gives those prefetches up (:meth:`LookupService.abandon`:
a lookup with ``cancel_prefetch`` on each rank's lane, after its lookup).

Primitives: :class:`LookupService`, :class:`Answer`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..lanes import Lane


@dataclasses.dataclass
class Answer:
    """Which leading keys every rank's namespace holds."""

    tiers: list[str]
    """The daemon tier of each leading key held by every rank (the first rank's tier)."""
    daemon_down: bool
    """A rank's client found the daemon down: nothing more will arrive soon."""
    seconds: float
    """From the ask to the last rank's answer."""
    counted: bool = False
    """Already counted in the scheduler's stats (an answer may be read on several steps)."""
    then: list[Any] = dataclasses.field(default_factory=list)
    """Per rank, what the ask's ``then`` returned (empty without one)."""


Then = Callable[[Any, int, list[str]], Any]
"""``then(transfer, rank, tiers)``: more lookups a rank's lane makes after the chunks'
(a Mamba hybrid's states, :mod:`.statescheduling`), on that lane's client."""


def _ask(transfer: Any, keys: Sequence[bytes], prefetch: bool) -> tuple[list[str], bool]:
    tiers = transfer.lookup_tiers(keys, prefetch=prefetch)
    return list(tiers), bool(transfer.client.fail_open_stats.get("down"))


_Result = tuple[list[str], bool, Any]


@dataclasses.dataclass
class _Asked:
    futures: list[concurrent.futures.Future[_Result]]
    at: float
    keys: list[bytes]
    prefetch: bool
    answer: Answer | None = None


class LookupService:
    """One lane per tensor-parallel rank; answers kept per request until forgotten."""

    def __init__(self, lanes: Sequence[Lane], *, prefetch: bool = False):
        if not lanes:
            raise ValueError("a lookup service needs one lane per rank")
        self.lanes = list(lanes)
        self.prefetch = prefetch
        self._asked: dict[str, _Asked] = {}
        self.cancelled_prefetches = 0
        """Cancels sent (one per rank) for requests that ended before their load."""

    def ask(self, req_id: str, keys: Sequence[bytes], then: Then | None = None) -> None:
        """Send the lookup of ``keys`` for ``req_id`` unless one is out or answered;
        ``then``: each rank's lane runs it after its lookup (:data:`Then`)."""
        if req_id in self._asked:
            return
        keys = list(keys)
        prefetch = self.prefetch

        def job(transfer: Any, rank: int) -> _Result:
            tiers, down = _ask(transfer, keys, prefetch)
            return tiers, down, then(transfer, rank, tiers) if then is not None else None

        no_answer: _Result = ([], False, None)
        futures = [lane.submit(functools.partial(job, rank=rank), no_answer) for rank, lane in enumerate(self.lanes)]
        self._asked[req_id] = _Asked(futures, time.perf_counter(), keys, prefetch)

    def asked(self, req_id: str) -> bool:
        return req_id in self._asked

    def answer(self, req_id: str, wait_s: float = 0.0) -> Answer | None:
        """The answer for ``req_id`` when every rank has answered (waiting up to ``wait_s``)."""
        asked = self._asked.get(req_id)
        if asked is None:
            return None
        if asked.answer is None:
            if wait_s > 0:
                concurrent.futures.wait(asked.futures, timeout=wait_s)
            if not all(f.done() for f in asked.futures):
                return None
            results = [f.result() for f in asked.futures]
            tiers = results[0][0]
            for rank_tiers, _, _ in results[1:]:
                tiers = tiers[: len(rank_tiers)]
            down = any(down for _, down, _ in results)
            asked.answer = Answer(tiers, down, time.perf_counter() - asked.at, then=[r[2] for r in results])
        return asked.answer

    def forget(self, req_id: str) -> None:
        """Drop the request's answer: the next ask sends a new lookup."""
        self._asked.pop(req_id, None)

    def abandon(self, req_id: str) -> None:
        """The request ended before its load: forget it, and where its lookup asked the
        daemon to prefetch chunks of a lower tier, cancel those prefetches (on each rank's
        lane, after its lookup; counted in ``cancelled_prefetches``)."""
        asked = self._asked.pop(req_id, None)
        if asked is None or not asked.prefetch:
            return
        keys = asked.keys
        for lane, future in zip(self.lanes, asked.futures):

            def job(transfer: Any, future: concurrent.futures.Future[_Result] = future) -> None:
                tiers = future.result()[0]  # done: the lane ran the lookup first
                if any(tier != "memory" for tier in tiers):  # else the daemon started no prefetch
                    self.cancelled_prefetches += 1
                    transfer.cancel_prefetch(keys, len(tiers))

            lane.submit(job, None)

    def close(self) -> None:
        for lane in self.lanes:
            lane.close()
