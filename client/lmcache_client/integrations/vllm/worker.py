"""Worker side of the vLLM connector: chunks in and out of the paged KV cache.

At ``register_kv_caches`` the layout of vLLM's caches is read from vLLM
(:func:`.layout.discover`).  Then, per engine step, with the step's
:class:`~.meta.LMCacheServerConnectorMetadata`:

- :meth:`WorkerSide.load` (``start_load_kv``, before the forward pass)
  scatters each load's chunks into the request's blocks for every layer,
  straight out of the daemon's pool slots where it shares them (one copy),
  through payload frames otherwise.  Only a leading run of valid chunks is
  used; the blocks of tokens that could not be loaded (a miss, a chunk of
  the wrong size, the daemon down, a lease that lapsed mid-copy) are reported
  by :meth:`WorkerSide.take_failed_blocks`, so vLLM recomputes them: a failed
  load costs a recompute, never garbage.
- :meth:`WorkerSide.save` (``wait_for_save``, after the forward pass and
  before the step ends, so blocks are not reused yet) gathers each save's
  chunks of every layer straight into reserved pool slots and commits them
  (the save path: :mod:`.saves`).

With several KV cache groups (vLLM's hybrid manager, sliding-window models)
each group's layers move through their own copier and block table, a
sliding-window group's null blocks are never touched, and failed loads are
reported per request (:meth:`WorkerSide.take_failed_requests`; :mod:`.groups`).

In the synchronous mode loads and saves complete within the step (the
asynchronous one runs them on lanes: :mod:`.transfers`; layer-wise saves:
:mod:`.layerwise`).  :class:`~.workerstats.WorkerStats` counts what moved, for
vLLM's own connector metrics.

Primitives: :class:`WorkerSide` (its counters: :mod:`.workerstats`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..batched import BatchedCopies, Part
from ..layout import ChunkLayout
from ..paged import Slots, blocks_covering, token_slots
from ..transfer import ChunkTransfer
from .groups import GroupSlots, group_slots
from .layerwise import LayerwiseSaver, saver_for
from .layout import EngineLayout, discover
from .meta import LoadRequest
from .saves import Saves, _part
from .states import StateMover, StateSave, StateWiring
from .workerstats import LoadResult, WorkerStats

__all__ = ["LoadResult", "WorkerSide", "WorkerStats"]

logger = logging.getLogger(__name__)


def _torch() -> Any:
    import torch

    return torch


class WorkerSide(Saves):
    """One worker (one TP rank); its namespace comes with ``transfers[0]``."""

    def __init__(
        self, transfer: ChunkTransfer, layout: ChunkLayout, *, copy_threads: int = 2, batch_copies: str = "auto"
    ):
        self.transfer = transfer
        self.layout = layout
        self.copy_threads = copy_threads
        self.batch_copies = batch_copies
        self.batched: BatchedCopies | None = None
        """Loads copy each daemon batch of chunks in one go (``batch_copies``; :mod:`..batched`)."""
        self.engine: EngineLayout | None = None
        self.stats = WorkerStats()
        self.asleep = False
        self.stores = True
        """False on the ranks that load but never store (MLA: rank 0 stores for all)."""
        """vLLM's sleep mode: the caches are unmapped, nothing may touch them."""
        self.totals: dict[str, float] = {}
        """Every counter since start (``stats`` restarts whenever vLLM takes it)."""
        self._failed: set[int] = set()
        self._failed_requests: set[str] = set()
        """Several KV cache groups: failed loads are reported per request (``failed_recving``)."""
        self.states: StateWiring | None = None
        """A Mamba hybrid (:mod:`.states`): set before ``register``; its states move beside the chunks."""
        self.state_namespace: Any = None
        """The states' namespace (with ``states``)."""
        self._mover: StateMover | None = None
        self.layerwise_bytes = 0
        """``layerwise_save``: staging bytes for layer-wise saves (0: off; :mod:`.layerwise`)."""
        self.layerwise: LayerwiseSaver | None = None

    # -- register_kv_caches ---------------------------------------------------------
    def register(self, kv_caches: dict[str, Any], vllm_config: Any, kv_cache_config: Any) -> EngineLayout:
        """Read vLLM's layout from vLLM and check it against the namespace's."""
        if self.states is not None:  # the chunks hold the attention groups; the states the rest
            bound = self.states.layout.bind(self.states.state_caches(kv_caches, vllm_config))
            self._mover = StateMover(bound, self.state_namespace)
            kv_caches = {n: t for n, t in kv_caches.items() if n in self.states.attention_layers}
            kv_cache_config = self.states.attention_config
        self.engine = discover(kv_caches, vllm_config, kv_cache_config, self.layout, copy_threads=self.copy_threads)
        if self.engine.copier.device.type == "cuda" and self.transfer.client.pin_shared_pool():
            logger.info("daemon's shared pool page-locked for CUDA copies")
        cuda = self.engine.copier.device.type == "cuda"
        if self.batch_copies == "on" or (self.batch_copies == "auto" and cuda):
            self.batched = BatchedCopies(self.engine.copier)
        if self.layerwise_bytes:
            shape = tuple(self.layout.shape)
            self.layerwise = saver_for(self.engine, self.states is not None, shape, self.layerwise_bytes)
        logger.info("lmcache-server connector: vLLM KV layout %s", self.engine.describe())
        return self.engine

    def _engine(self) -> EngineLayout:
        if self.engine is None:
            raise RuntimeError("register_kv_caches has not been called")
        return self.engine

    def _payload(self, view: memoryview, lo: int = 0, hi: int | None = None, *, tokens: int | None = None) -> Any:
        """A chunk payload tensor over ``view``: ``(layers, 2, tokens, heads, dim)``, tokens
        sliced; ``tokens``: a tail of that many tokens instead of a full chunk."""
        torch = _torch()
        engine = self._engine()
        flat = torch.frombuffer(view, dtype=torch.uint8) if view.nbytes else torch.empty(0, dtype=torch.uint8)
        shape = list(self.layout.shape)
        if tokens is not None:
            shape[2] = tokens
        payload = flat.view(engine.copier.dtype).view(shape)
        return payload if lo == 0 and hi is None else payload[:, :, lo:hi]

    def tail_bytes(self, tokens: int) -> int:
        """Bytes of a tail payload of ``tokens`` tokens."""
        return self.layout.nbytes // self.layout.chunk_size * tokens

    # -- start_load_kv ---------------------------------------------------------------
    def load(self, loads: list[LoadRequest]) -> None:
        """Load every request of the step now (the synchronous mode; asynchronous
        loads go through :mod:`.transfers`, which calls :meth:`load_one` on a lane)."""
        if self.asleep:  # pragma: no cover - vLLM schedules nothing while asleep
            for request in loads:
                self.finish_load(request, LoadResult(request.start_token))
            return
        for request in loads:
            self.finish_load(request, self.load_one(request, self.transfer))

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

    def finish_load(self, request: LoadRequest, result: LoadResult) -> None:
        """Count a finished load; the blocks it did not fill are reported as failed."""
        self.stats.load_s += result.seconds
        self.stats.loaded_bytes += result.nbytes
        self.stats.loaded_tokens += result.end - request.start_token
        if result.late:
            self.stats.load_deadline_missed += 1
        if result.end < request.end_token:
            failed = blocks_covering(request.block_ids, result.end, request.end_token, self._engine().block_size)
            if self._engine().groups or self.states is not None:  # vLLM 0.32: per request with several groups
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
                "the request is recomputed"
                if self._engine().groups or self.states is not None
                else f"{len(failed)} blocks to recompute",
            )

    def _load_one(
        self, request: LoadRequest, transfer: ChunkTransfer, result: LoadResult, deadline: float | None
    ) -> int:
        """Scatter what can be loaded; returns the end of the tokens written."""
        engine = self._engine()
        chunk = self.layout.chunk_size
        base = request.first_chunk * chunk
        slots = self._slots(request.block_ids, request.group_block_ids, request.start_token, request.end_token)
        used = [0]  # leading chunks scattered before the deadline
        batched = self.batched if isinstance(slots, Slots) else None  # several groups: chunk by chunk
        pending: list[Part] = []
        tail = False

        def scatter(i: int, view: memoryview) -> None:
            if deadline is not None and (result.late or time.monotonic() > deadline):
                result.late = True
                return
            c0 = base + i * chunk
            lo, hi = max(c0, request.start_token), min(c0 + chunk, request.end_token)
            part = slice(lo - request.start_token, hi - request.start_token)
            target, payload = _part(slots, part), self._payload(view, lo - c0, hi - c0)
            if batched is not None and isinstance(target, Slots):
                pending.append(Part(target, payload))  # copied at flush, while the views are leased
            else:
                self._scatter(target, payload)
            result.nbytes += view.nbytes
            used[0] = i + 1

        if batched is not None:
            copies = batched

            def flush() -> None:
                """The daemon batch's chunks in one go (get_prefix_with calls it before their
                leases end); on CUDA this waits for the batch's event, on the lane's thread."""
                if pending:
                    copies.scatter(pending).wait()
                    pending.clear()

            scatter.flush = flush  # type: ignore[attr-defined]

        loaded = transfer.get_prefix_with(request.keys, scatter) if request.keys else 0
        loaded = min(loaded, used[0])
        covered = base + loaded * chunk
        if request.tail_key is not None and loaded == len(request.keys) and not result.late:
            t0, n = covered, request.tail_tokens
            lo, hi = max(t0, request.start_token), min(t0 + n, request.end_token)

            def scatter_tail(_: int, view: memoryview) -> None:
                part = slice(lo - request.start_token, hi - request.start_token)
                payload = self._payload(view, lo - t0, hi - t0, tokens=n)
                self._scatter(_part(slots, part), payload)
                result.nbytes += view.nbytes

            if hi > lo and transfer.get_one_with(request.tail_key, self.tail_bytes(n), scatter_tail):
                covered = t0 + n
                tail = True  # copied chunk by chunk on this thread's stream
        if engine.copier.device.type == "cuda" and (batched is None or tail):  # else each batch's event was waited
            _torch().cuda.current_stream().synchronize()
        if request.state_tokens and not self._load_state(request, transfer, covered, result):
            return request.start_token  # no state of exactly this length: the request is recomputed
        return max(request.start_token, min(request.end_token, covered))

    def _load_state(self, request: LoadRequest, transfer: ChunkTransfer, covered: int, result: LoadResult) -> bool:
        """Write the request's Mamba state once every chunk up to it is in (:mod:`.states`)."""
        if self._mover is None or result.late:
            return False
        nbytes = self._mover.load(request, transfer, covered)
        result.nbytes += nbytes
        return nbytes > 0

    @property
    def state_mover(self) -> StateMover | None:
        """A Mamba hybrid's state mover (after ``register``); None otherwise."""
        return self._mover

    def save_states(self, saves: list[StateSave]) -> int:
        """Copy out and store the Mamba states vLLM handed off in this step (now: vLLM may
        reuse their blocks from the next step on); returns states stored.  Never raises."""
        if self._mover is None or not self.stores or self.asleep:
            return 0
        stored = self._mover.save(saves, self.transfer)
        self.stats.stored_states += stored
        return stored

    def take_stats(self) -> dict[str, float]:
        self.stats.add_to(self.totals)
        return self.stats.take()

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def take_failed_requests(self) -> set[str]:
        """Requests whose load failed in part or whole (several KV cache groups only)."""
        failed, self._failed_requests = self._failed_requests, set()
        return failed

    def _slots(self, block_ids: list[int], group_block_ids: Any, start: int, end: int) -> Slots | GroupSlots:
        """Where tokens ``[start, end)`` sit: one group's slots, or each group's (:mod:`.groups`)."""
        engine = self._engine()
        if engine.groups:
            if group_block_ids is None:
                raise ValueError("several KV cache groups, but the request carries one group's blocks")
            return group_slots(engine.groups, group_block_ids, start, end, engine.block_size, engine.block_tokens)
        return token_slots(block_ids, start, end, engine.block_size, engine.block_tokens)

    def _scatter(self, slots: Slots | GroupSlots, payload: Any) -> None:
        if isinstance(slots, GroupSlots):
            slots.scatter(payload)
        else:
            self._engine().copier.scatter(slots, payload)

    def _gather(self, slots: Slots | GroupSlots, payload: Any) -> None:
        if isinstance(slots, GroupSlots):
            slots.gather(payload)
        else:
            self._engine().copier.gather(slots, payload)
