"""Worker side of the vLLM connector: chunks in and out of the paged KV cache.

At ``register_kv_caches`` the layout of vLLM's caches is read from vLLM
(:func:`..discovery.discover`) and the worker builds its parts over it:

- :class:`~.chunkcopies.CacheCopies`, the one copy mechanism loads and saves
  share (one KV cache group or many, batched or chunk by chunk);
- :class:`~.loads.Loads` (``start_load_kv``, before the forward pass): each
  load's chunks scattered into the request's blocks; the blocks (with several
  KV cache groups: the requests) whose tokens could not be loaded are
  reported by :meth:`WorkerSide.take_failed_blocks` and
  :meth:`WorkerSide.take_failed_requests`, so vLLM recomputes them;
- :class:`~.saves.Saves` (``wait_for_save``, after the forward pass and before
  the step ends, so blocks are not reused yet): each save's chunks gathered
  straight into reserved pool slots and committed, or taken from the staging a
  :class:`~.layerwise.LayerwiseSaver` filled layer by layer (``layerwise_save``);
- a Mamba hybrid's :class:`~.statemover.StateMover` (states beside the chunks).

In the synchronous mode loads and saves complete within the step (the
asynchronous one runs :meth:`WorkerSide.load_one` and
:meth:`WorkerSide.save_one` on lanes: :mod:`.transferengine`).
:class:`~.workerstats.WorkerStats` counts what moved, for vLLM's own
connector metrics.

Primitive: :class:`WorkerSide`.
"""

from __future__ import annotations

import logging
from typing import Any

from ...chunklayout import ChunkLayout
from ...transfer import ChunkTransfer
from ..discovery import discover
from ..enginelayout import EngineLayout
from ..meta import LoadRequest, SaveRequest
from ..states import StateSave, StateWiring
from .chunkcopies import CacheCopies
from .layerwise import LayerwiseSaver, Staged, saver_for
from .loads import Loads
from .payloads import Payloads
from .saves import Saves
from .statemover import StateMover
from .workerstats import LoadResult, WorkerStats

__all__ = ["LoadResult", "WorkerSide", "WorkerStats"]

logger = logging.getLogger(__name__)


class WorkerSide:
    """One worker (one TP rank); its namespace comes with ``transfer``.

    ``batch_copies``: ``on``, ``off`` or ``auto`` (on a CUDA cache); ``stores``:
    False on the ranks that load but never store (MLA: rank 0 stores for all);
    ``layerwise_bytes``: staging bytes for layer-wise saves (0: off); ``states``
    and ``state_namespace``: a Mamba hybrid's wiring and its states' namespace.
    """

    def __init__(
        self,
        transfer: ChunkTransfer,
        layout: ChunkLayout,
        *,
        copy_threads: int = 2,
        batch_copies: str = "auto",
        stores: bool = True,
        layerwise_bytes: int = 0,
        states: StateWiring | None = None,
        state_namespace: str | None = None,
    ):
        self.transfer = transfer
        self.layout = layout
        self.copy_threads = copy_threads
        self.batch_copies = batch_copies
        self.stores = stores
        self.layerwise_bytes = layerwise_bytes
        self.states = states
        self.state_namespace = state_namespace
        self.stats = WorkerStats()
        self.totals: dict[str, float] = {}
        """Every counter since start (``stats`` restarts whenever vLLM takes it)."""
        self._asleep = False
        # The parts, built by ``register`` over vLLM's caches:
        self.engine: EngineLayout | None = None
        self.cache: CacheCopies | None = None
        self.layerwise: LayerwiseSaver | None = None
        self._mover: StateMover | None = None
        self._loads: Loads | None = None
        self._saves: Saves | None = None

    @property
    def asleep(self) -> bool:
        """vLLM's sleep mode: the caches are unmapped, nothing may touch them."""
        return self._asleep

    def sleep(self) -> None:
        """The caches go away (``unregister_kv_caches``): load and store nothing until ``wake``."""
        self._asleep = True

    def wake(self) -> None:
        """The same caches are back (``restore_kv_caches``)."""
        self._asleep = False

    # -- register_kv_caches ---------------------------------------------------------

    def register(self, kv_caches: dict[str, Any], vllm_config: Any, kv_cache_config: Any) -> EngineLayout:
        """Read vLLM's layout from vLLM, check it against the namespace's, build the parts."""
        if self.states is not None:  # the chunks hold the attention groups; the states the rest
            bound = self.states.layout.bind(self.states.state_caches(kv_caches, vllm_config))
            assert self.state_namespace is not None
            self._mover = StateMover(bound, self.state_namespace)
            kv_caches = {n: t for n, t in kv_caches.items() if n in self.states.attention_layers}
            kv_cache_config = self.states.attention_config
        engine = discover(kv_caches, vllm_config, kv_cache_config, self.layout, copy_threads=self.copy_threads)
        self.attach(engine)
        logger.info("lmcache-server connector: vLLM KV layout %s", engine.describe())
        return engine

    def attach(self, engine: EngineLayout) -> None:
        """Build the parts over ``engine`` (``register`` discovers it; a benchmark may make its own)."""
        self.engine = engine
        cuda = engine.copier.device.type == "cuda"
        if cuda and self.transfer.client.pin_shared_pool():
            logger.info("daemon's shared pool page-locked for CUDA copies")
        batched = self.batch_copies == "on" or (self.batch_copies == "auto" and cuda)
        self.cache = CacheCopies(engine, batched=batched)
        if self.layerwise_bytes:
            shape = tuple(self.layout.shape)
            self.layerwise = saver_for(engine, self.states is not None, shape, self.layerwise_bytes)
        payloads = Payloads(self.layout, engine.copier.dtype)
        per_request = bool(engine.groups) or self.states is not None
        self._loads = Loads(self.cache, payloads, self.stats, self._mover, per_request=per_request)
        self._saves = Saves(self.cache, payloads, self.stats, self.layerwise, stores=self.stores)

    def _loading(self) -> Loads:
        if self._loads is None:
            raise RuntimeError("register_kv_caches has not been called")
        return self._loads

    def _saving(self) -> Saves:
        if self._saves is None:
            raise RuntimeError("register_kv_caches has not been called")
        return self._saves

    def tail_bytes(self, tokens: int) -> int:
        """Bytes of a tail payload of ``tokens`` tokens."""
        return self.layout.nbytes // self.layout.chunk_size * tokens

    # -- start_load_kv ---------------------------------------------------------------
    def load(self, loads: list[LoadRequest]) -> None:
        """Load every request of the step now (the synchronous mode; asynchronous
        loads go through :mod:`.transferengine`, which calls :meth:`load_one` on a lane)."""
        if self.asleep:  # pragma: no cover - vLLM schedules nothing while asleep
            for request in loads:
                self.finish_load(request, LoadResult(request.start_token))
            return
        for request in loads:
            self.finish_load(request, self.load_one(request, self.transfer))

    def load_one(self, request: LoadRequest, transfer: ChunkTransfer, deadline: float | None = None) -> LoadResult:
        """Scatter what can be loaded of ``request`` through ``transfer``; never raises.
        ``deadline`` (monotonic seconds): chunks that arrive later are not used."""
        return self._loading().load_one(request, transfer, deadline)

    def finish_load(self, request: LoadRequest, result: LoadResult) -> None:
        """Count a finished load; the blocks it did not fill are reported as failed."""
        self._loading().finish(request, result)

    def take_failed_blocks(self) -> set[int]:
        return self._loads.take_failed_blocks() if self._loads is not None else set()

    def take_failed_requests(self) -> set[str]:
        """Requests whose load failed in part or whole (several KV cache groups only)."""
        return self._loads.take_failed_requests() if self._loads is not None else set()

    # -- save_kv_layer / wait_for_save -------------------------------------------------
    def save_layer(self, step: Any, saves: list[SaveRequest], layer_name: str) -> None:
        """Copy layer ``layer_name`` of the step's saves out now (``layerwise_save``)."""
        if self._saves is not None and not self.asleep:
            self._saves.save_layer(step, saves, layer_name)

    def take_staged(self, step: Any, saves: list[SaveRequest]) -> list[Staged | None] | None:
        """The step's layer-wise copies, aligned with ``saves`` (None: no layer-wise save)."""
        return self._saves.take_staged(step, saves) if self._saves is not None else None

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
        Never raises: a failed save is a future miss, never an engine failure."""
        return self._saving().save_one(request, transfer, staged)

    def finish_save(self, request: SaveRequest, done: int, seconds: float) -> None:
        """Count a finished save."""
        self._saving().finish(request, done, seconds)

    # -- Mamba states ------------------------------------------------------------------
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

    # -- stats and shutdown ------------------------------------------------------------
    def take_stats(self) -> dict[str, float]:
        self.stats.add_to(self.totals)
        return self.stats.take()

    def close(self) -> None:
        """Stop the copy threads (the engine copier's, the layer-wise saver's)."""
        if self.engine is not None:
            self.engine.copier.close()
        if self.layerwise is not None:
            self.layerwise.close()
