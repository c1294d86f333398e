"""Worker side of the vLLM connector: chunks in and out of the paged KV cache.

Per engine step, with the step's :class:`~.vllm_meta.LMCacheServerConnectorMetadata`:

- :meth:`WorkerSide.load` (``start_load_kv``, before the forward pass) fetches
  each load's chunks and scatters their tokens into the request's blocks for
  every layer.  Only a leading run of valid chunks is used; the blocks of the
  tokens that could not be loaded (a miss, a wrong-sized payload, the daemon
  down) are reported by :meth:`WorkerSide.take_failed_blocks` so vLLM
  recomputes them: a failed load costs a recompute, never garbage.
- :meth:`WorkerSide.save_layer` (``save_kv_layer``, after each attention layer
  wrote its KV) gathers that layer's rows of every save into a host staging
  buffer; :meth:`WorkerSide.finish_saves` (``wait_for_save``, before the step
  ends and blocks can be reused) gathers any layer it did not see, then puts
  the chunks.

Loads and saves complete within the step (nothing outlives it, so
``get_finished`` has nothing to report).

Primitive: :class:`WorkerSide`.
"""

from __future__ import annotations

import logging
from typing import Any

from ..tensors import tensor_bytes
from .layout import ChunkLayout
from .paged import blocks_covering, check_layer, chunks_to_tokens, gather_layer, scatter_layer, token_slots
from .paged import tokens_to_chunks as _tokens_to_chunks
from .transfer import ChunkTransfer
from .vllm_meta import LoadRequest, SaveRequest

logger = logging.getLogger(__name__)


def _torch() -> Any:
    import torch

    return torch


class WorkerSide:
    """One worker (one TP rank); its namespace comes with ``transfer``."""

    def __init__(self, transfer: ChunkTransfer, layout: ChunkLayout):
        self.transfer = transfer
        self.layout = layout
        self.layers: list[Any] = []
        self.layer_index: dict[str, int] = {}
        self.block_size = 0
        self._failed: set[int] = set()
        self._staging: dict[int, Any] = {}
        self._gathered: dict[int, set[int]] = {}

    # -- register_kv_caches ---------------------------------------------------------
    def register(self, kv_caches: dict[str, Any]) -> None:
        """Take the per-layer caches, in the model's layer order, and check them
        against the layout the namespace promises."""
        if len(kv_caches) != self.layout.num_layers:
            raise ValueError(f"{len(kv_caches)} KV cache layers, the model config says {self.layout.num_layers}")
        shapes = {name: check_layer(t) for name, t in kv_caches.items()}
        first = next(iter(shapes.values()))
        want = (self.layout.num_kv_heads, self.layout.head_dim)
        for name, shape in shapes.items():
            if (shape.num_kv_heads, shape.head_dim) != want or shape.block_size != first.block_size:
                raise ValueError(f"layer {name}: cache shape {tuple(shape)} does not match {want}")
            if kv_caches[name].element_size() != self.layout.element_bytes:
                raise ValueError(f"layer {name}: {kv_caches[name].dtype} does not match {self.layout.dtype}")
        self.layers = list(kv_caches.values())
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        self.block_size = first.block_size

    @property
    def _row_bytes(self) -> int:
        return self.layout.head_dim * self.layout.element_bytes

    def _staging_for(self, n_chunks: int) -> Any:
        """A host buffer of ``n_chunks`` payloads, ``(n, layers, 2, chunk, heads, dim bytes)`` uint8."""
        torch = _torch()
        layers, _, chunk, heads, _ = self.layout.shape
        pinned = bool(self.layers) and self.layers[0].is_cuda
        return torch.empty((n_chunks, layers, 2, chunk, heads, self._row_bytes), dtype=torch.uint8, pin_memory=pinned)

    # -- start_load_kv ---------------------------------------------------------------
    def load(self, loads: list[LoadRequest]) -> None:
        for request in loads:
            try:
                loaded_end = self._load_one(request)
            except Exception:  # a bug or a device error: recompute, do not crash the engine
                logger.exception("loading KV for request %s failed", request.req_id)
                loaded_end = request.start_token
            if loaded_end < request.end_token:
                failed = blocks_covering(request.block_ids, loaded_end, request.end_token, self.block_size)
                self._failed.update(failed)
                logger.warning(
                    "request %s: %d of %d tokens loaded; %d blocks to recompute",
                    request.req_id,
                    loaded_end - request.start_token,
                    request.end_token - request.start_token,
                    len(failed),
                )

    def _load_one(self, request: LoadRequest) -> int:
        """Scatter what can be loaded; returns the end of the tokens written."""
        chunk = self.layout.chunk_size
        staging = self._staging_for(len(request.keys))
        loaded = self.transfer.get_prefix_into(request.keys, [staging[i] for i in range(len(request.keys))])
        base = request.first_chunk * chunk
        end = min(request.end_token, base + loaded * chunk)
        if end <= request.start_token:
            return request.start_token
        staging = staging[:loaded]
        slots = token_slots(request.block_ids, request.start_token, end, self.block_size)
        lo, hi = request.start_token - base, end - base
        for layer, kv_layer in enumerate(self.layers):
            rows = chunks_to_tokens(staging[:, layer])[:, lo:hi]
            scatter_layer(kv_layer, slots, rows)
        return end

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    # -- save_kv_layer / wait_for_save -----------------------------------------------
    def save_layer(self, layer_name: str, kv_layer: Any, saves: list[SaveRequest]) -> None:
        layer = self.layer_index.get(layer_name)
        if layer is None:
            return
        for index, request in enumerate(saves):
            self._gather(index, request, layer, kv_layer)

    def _gather(self, index: int, request: SaveRequest, layer: int, kv_layer: Any) -> None:
        chunk = self.layout.chunk_size
        staging = self._staging.get(index)
        if staging is None:
            staging = self._staging[index] = self._staging_for(len(request.keys))
            self._gathered[index] = set()
        start = request.first_chunk * chunk
        slots = token_slots(request.block_ids, start, start + len(request.keys) * chunk, self.block_size)
        rows = gather_layer(kv_layer, slots)
        staging[:, layer].copy_(_tokens_to_chunks(rows, chunk), non_blocking=staging.is_pinned())
        self._gathered[index].add(layer)

    def finish_saves(self, saves: list[SaveRequest]) -> int:
        """Gather the layers ``save_layer`` did not see, then store; returns chunks stored."""
        torch = _torch()
        stored = 0
        try:
            for index, request in enumerate(saves):
                for layer, kv_layer in enumerate(self.layers):
                    if layer not in self._gathered.get(index, ()):
                        self._gather(index, request, layer, kv_layer)
            if self.layers and self.layers[0].is_cuda:
                torch.cuda.current_stream().synchronize()  # pinned copies were asynchronous
            for index, request in enumerate(saves):
                staging = self._staging[index]
                stored += self.transfer.put(request.keys, [tensor_bytes(staging[i]) for i in range(len(request.keys))])
        except Exception:  # a failed save is a future miss, never an engine failure
            logger.exception("saving KV chunks failed")
        finally:
            self._staging.clear()
            self._gathered.clear()
        return stored
