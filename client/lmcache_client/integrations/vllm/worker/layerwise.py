"""Layer-wise saves (``layerwise_save``): a save's tokens leave the KV cache layer by
layer, while vLLM's forward pass is still computing the next layers.

vLLM calls ``save_kv_layer`` right after each attention layer of the forward
pass has written the step's keys and values.  With ``layerwise_save`` on, the
worker copies that layer's tokens of every save of the step into a host staging
buffer then and there: on CUDA on a side stream ordered after the layer (an
event), so the device-to-host copy overlaps the next layers' compute; on a CPU
on a copier thread of its own.  ``wait_for_save`` then stores from the staging
buffers, in the step (synchronous mode) or on the save lane (asynchronous): the
store no longer reads the KV cache.

What it costs: one more host copy per chunk (staging buffer -> the daemon's pool
slot), and staging memory (``layerwise_staging_mb``, page-locked on CUDA, reused
from step to step).  A save that does not fit the staging budget, and every save
of a step in which vLLM did not call ``save_kv_layer`` for every layer (CUDA
graphs captured whole, a backend without the hook), is gathered from the cache
at ``wait_for_save`` as without the setting (counted: ``layerwise_fallbacks``).
The blocks a save reads are held exactly as without it (``delay_free`` in the
asynchronous mode), so a fallback is always safe.

Models with one KV cache group and the standard K/V layout only (the
connector refuses the setting at start otherwise).

Primitives: :class:`LayerwiseSaver`, :class:`Staged`, :func:`saver_for`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from typing import Any

from ...paged import PagedCopier, Slots
from ..meta import SaveRequest

logger = logging.getLogger(__name__)

__all__ = ["LayerwiseSaver", "Staged", "saver_for"]


def _torch() -> Any:
    import torch

    return torch


class _Arena:
    """Staging buffers, reused from step to step; at most ``max_bytes`` allocated."""

    def __init__(self, max_bytes: int, pinned: bool):
        self.max_bytes = max_bytes
        self.pinned = pinned
        self.allocated = 0
        self._free: list[Any] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Any | None:
        """A uint8 buffer of at least ``nbytes`` (at most twice), or None over budget."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if nbytes <= b.numel() <= 2 * nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            while self._free and self.allocated + nbytes > self.max_bytes:
                self.allocated -= self._free.pop(0).numel()  # unused sizes make room
            if self.allocated + nbytes > self.max_bytes:
                return None
            self.allocated += nbytes
        return _torch().empty(nbytes, dtype=_torch().uint8, pin_memory=self.pinned)

    def give(self, buf: Any) -> None:
        with self._lock:
            self._free.append(buf)


@dataclasses.dataclass
class _Range:
    plan: tuple[Slots, Any]
    staging: Any
    """``(layers, planes, tokens, heads, dim)`` host tensor the layers are copied into."""


@dataclasses.dataclass
class Staged:
    """One save's tokens, copied out layer by layer (or on their way)."""

    request: SaveRequest
    full: _Range | None
    tail: _Range | None
    num_layers: int
    seen: set[int] = dataclasses.field(default_factory=set)
    futures: list[concurrent.futures.Future[None]] = dataclasses.field(default_factory=list)
    event: Any = None
    """CUDA: recorded on the side stream after the last layer's copy."""
    buffers: list[Any] = dataclasses.field(default_factory=list)
    arena: _Arena | None = None

    def chunk(self, i: int, chunk_size: int) -> Any:
        assert self.full is not None
        return self.full.staging[:, :, i * chunk_size : (i + 1) * chunk_size]

    def tail_tokens(self) -> Any:
        assert self.tail is not None
        return self.tail.staging

    def wait(self) -> bool:
        """Wait for the copies; True when every layer arrived without an error."""
        ok = len(self.seen) == self.num_layers
        for future in self.futures:
            try:
                future.result()
            except Exception:  # a device error: the save gathers from the cache instead
                logger.exception("layer-wise copy of request %s failed", self.request.req_id)
                ok = False
        if self.event is not None:
            self.event.synchronize()
        return ok

    def release(self) -> None:
        """Hand the staging buffers back (after the store read them)."""
        if self.arena is not None:
            for buf in self.buffers:
                self.arena.give(buf)
        self.buffers = []


class LayerwiseSaver:
    """Copies the step's saves out of the KV cache as each layer of the forward pass ends."""

    def __init__(self, copier: PagedCopier, layer_names: list[str], payload_shape: tuple[int, ...], max_bytes: int):
        self.copier = copier
        self.index = {name: i for i, name in enumerate(layer_names)}
        self.shape = payload_shape
        """A chunk payload's shape ``(layers, planes, chunk_size, heads, dim)``."""
        cuda = copier.device.type == "cuda"
        self.arena = _Arena(max_bytes, pinned=cuda)
        self.stream = _torch().cuda.Stream() if cuda else None
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._step: Any = None
        self._staged: list[Staged | None] = []

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    # -- per step ------------------------------------------------------------------------
    def layer(self, step: Any, saves: list[SaveRequest], slots_of: Any, name: str) -> None:
        """``save_kv_layer``: copy layer ``name`` of every save of ``step`` (the step's
        metadata; its first call stages the saves).  ``slots_of(start, end, request)``:
        the Slots of a request's token range.  Never raises."""
        try:
            if step is not self._step:
                self._begin(step, saves, slots_of)
            i = self.index.get(name)
            if i is None or not self._staged:
                return
            if self.stream is not None:
                self._layer_cuda(i)
            else:
                self._layer_cpu(i)
        except Exception:  # the save falls back to the gather at wait_for_save
            logger.exception("layer-wise save of layer %s failed", name)
            for staged in self._staged:
                if staged is not None:
                    staged.seen.clear()

    def end(self, step: Any) -> list[Staged | None]:
        """``wait_for_save``: the step's staged saves, aligned with its saves (None: gather
        from the cache).  A staged save that misses a layer is released and None."""
        staged = self._staged if step is self._step else []
        self._step, self._staged = None, []
        if staged and self.stream is not None:
            event = _torch().cuda.Event()
            event.record(self.stream)
            for s in staged:
                if s is not None:
                    s.event = event
        out: list[Staged | None] = []
        for s in staged:
            if s is not None and len(s.seen) != s.num_layers:
                s.wait()  # let copies already issued finish before the buffers are reused
                s.release()
                s = None
            out.append(s)
        return out

    def _begin(self, step: Any, saves: list[SaveRequest], slots_of: Any) -> None:
        for s in self._staged:  # a step whose wait_for_save never came
            if s is not None:
                s.wait()
                s.release()
        self._step = step
        self._staged = [self._stage(request, slots_of) for request in saves]

    def _stage(self, request: SaveRequest, slots_of: Any) -> Staged | None:
        chunk = self.shape[2]
        staged = Staged(request, None, None, len(self.index), arena=self.arena)
        start = request.first_chunk * chunk
        ranges = []
        if request.keys:
            ranges.append(("full", start, start + len(request.keys) * chunk))
        if request.tail_key is not None:
            ranges.append(("tail", request.tail_start, request.tail_start + request.tail_tokens))
        for which, lo, hi in ranges:
            shape = (self.shape[0], self.shape[1], hi - lo, *self.shape[3:])
            nbytes = self.copier.dtype.itemsize
            for n in shape:
                nbytes *= n
            buf = self.arena.take(nbytes)
            if buf is None:
                staged.release()
                return None
            staged.buffers.append(buf)
            staging = buf[:nbytes].view(self.copier.dtype).view(shape)
            setattr(staged, which, _Range(self.copier.layer_plan(slots_of(lo, hi, request)), staging))
        return staged

    def _layer_cpu(self, i: int) -> None:
        if self._thread is None:  # not the caller's thread: vLLM's carries its OpenMP setup
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lmcache-layerwise")
        torch = _torch()
        inference = torch.is_inference_mode_enabled()
        copier = self.copier

        def copy(ranges: list[_Range]) -> None:
            with torch.inference_mode(inference):
                for r in ranges:
                    copier.gather_layer(r.plan, i, r.staging[i : i + 1])

        for staged in self._staged:
            if staged is not None:
                ranges = [r for r in (staged.full, staged.tail) if r is not None]
                staged.futures.append(self._thread.submit(copy, ranges))
                staged.seen.add(i)

    def _layer_cuda(self, i: int) -> None:
        torch = _torch()
        assert self.stream is not None
        event = torch.cuda.Event()
        event.record()  # after this layer's attention wrote its cache
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(event)
            for staged in self._staged:
                if staged is None:
                    continue
                for r in (staged.full, staged.tail):
                    if r is not None:
                        shape = (1, *r.staging.shape[1:])
                        dest = torch.empty(shape, dtype=self.copier.dtype, device=self.copier.device)
                        self.copier.gather_layer(r.plan, i, dest)
                        r.staging[i : i + 1].copy_(dest, non_blocking=True)
                staged.seen.add(i)


def saver_for(engine: Any, has_states: bool, payload_shape: tuple[int, ...], max_bytes: int) -> LayerwiseSaver:
    """A saver for ``engine`` (an :class:`~.enginelayout.EngineLayout`); refuses, with a
    message for the operator, the models it does not serve."""
    if engine.groups or has_states or type(engine.copier) is not PagedCopier:
        kind = "several KV cache groups" if engine.groups or has_states else "an MLA latent cache"
        raise ValueError(
            f"lmcache-server connector: layerwise_save supports models with one KV cache group and "
            f"separate K and V; this model has {kind}: leave layerwise_save off"
        )
    return LayerwiseSaver(engine.copier, engine.layer_names, payload_shape, max_bytes)
