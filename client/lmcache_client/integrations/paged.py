"""Copies between an engine's paged KV cache and chunk payloads.

:class:`PagedCopier` moves token ranges between the layer caches and chunk
payloads of shape ``(layers, 2, tokens, kv_heads, head_dim)`` (see
:mod:`.chunklayout`), in one copy each way: straight into (or out of) the
destination, e.g. a slot of the daemon's shared pool.  Layers that share one
storage at a constant stride are copied together as one 5-D view.  Where K
and V sit inside a block (the :class:`BlockLayout` the copier works from) is
found by asking the engine: :mod:`.blocklayout`, whose names are importable
from here too.

Primitives: :func:`token_slots`, :func:`blocks_covering`, :class:`PagedCopier`
(and, from :mod:`.blocklayout`, :class:`Affine`, :class:`BlockLayout`,
:func:`probe_block_layout`, :class:`LayoutError`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .blocklayout import Affine as Affine  # re-exported: callers import these from here
from .blocklayout import BlockLayout as BlockLayout
from .blocklayout import LayoutError as LayoutError
from .blocklayout import WriteFn as WriteFn
from .blocklayout import probe_block_layout as probe_block_layout


def _torch() -> Any:
    import torch

    return torch


LayerWriteFn = Callable[[Any, Any, Any], None]
"""``write(key, value, slot_mapping)``: the engine's cache write into one layer's cache."""


class Slots(NamedTuple):
    """Kernel block and offset of each token of a range."""

    blocks: Any
    offsets: Any


def token_slots(
    block_ids: Sequence[int], start: int, end: int, block_size: int, block_tokens: int | None = None
) -> Slots:
    """Kernel block and offset of tokens ``[start, end)`` of a request whose scheduler
    blocks (of ``block_size`` tokens) are ``block_ids``.  When the attention kernel
    splits each block into kernel blocks of ``block_tokens``, scheduler block ``b``
    holds kernel blocks ``b*r .. b*r + r - 1`` (``r = block_size // block_tokens``)."""
    torch = _torch()
    kernel = block_tokens or block_size
    if block_size % kernel:
        raise LayoutError(f"kernel blocks of {kernel} tokens do not divide blocks of {block_size}")
    if not 0 <= start <= end:
        raise ValueError(f"bad token range [{start}, {end})")
    if end > len(block_ids) * block_size:
        raise ValueError(f"token {end - 1} is past the request's {len(block_ids)} blocks of {block_size}")
    positions = torch.arange(start, end, dtype=torch.long)
    table = torch.as_tensor(list(block_ids), dtype=torch.long)
    within = positions % block_size
    blocks = table[positions // block_size] * (block_size // kernel) + within // kernel
    return Slots(blocks, within % kernel)


def blocks_covering(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Scheduler block ids holding any token of ``[start, end)``."""
    if end <= start:
        return []
    return list(block_ids[start // block_size : (end + block_size - 1) // block_size])


@dataclasses.dataclass
class _Group:
    """Layers ``first .. first + count - 1``: one 5-D view each for K and V when they
    share a storage at a constant stride (else ``count`` is 1)."""

    first: int
    count: int
    key: Any = None
    value: Any = None
    flat: Any = None
    """Position-table layouts: a 1-D view of the layer's storage from its first element."""
    block_stride: int = 0
    both: Any = None
    """K and V as one 6-D view ``(count, blocks, tokens, heads, 2, dim)`` when V sits at
    a constant offset from K (``K || V`` per token): one pass over the cache instead of two."""


class PagedCopier:
    """Copies token ranges between per-layer paged caches and chunk payloads.

    ``layers`` are the per-layer cache tensors (logical ``(blocks, heads,
    block_tokens, C)``, any strides, one dtype), all with ``layout``.  Payloads
    are ``(layers, 2, tokens, heads, head_dim)`` tensors of the cache dtype.
    """

    #: Token ranges crossing at most this many block runs are copied run by run
    #: (``copy_`` of strided views); longer ones by one indexed gather per group.
    #: On a GPU each copy is a kernel launch, so long ranges of small blocks take
    #: the indexed gather sooner; on a CPU strided copies beat indexing by far.
    MAX_RUNS_CPU = 64
    MAX_RUNS_CUDA = 8

    def __init__(
        self,
        layers: Sequence[Any],
        layout: BlockLayout,
        writers: Sequence[LayerWriteFn] | None = None,
        *,
        threads: int = 2,
    ):
        if not layers:
            raise LayoutError("no KV cache layers")
        first = layers[0]
        for layer in layers:
            if tuple(layer.shape) != tuple(first.shape) or layer.stride() != first.stride():
                raise LayoutError(f"layers differ in shape or strides: {tuple(layer.shape)} vs {tuple(first.shape)}")
            if layer.dtype != first.dtype or layer.device != first.device:
                raise LayoutError("layers differ in dtype or device")
        if writers is not None and len(writers) != len(layers):
            raise LayoutError(f"{len(writers)} cache writes for {len(layers)} layers")
        self.layers = list(layers)
        self.layout = layout
        self.writers = list(writers) if writers is not None else None
        """The engine's own cache write per layer: scatters use it when given (the
        write the layout was probed from, typically faster than strided copies)."""
        self.dtype = first.dtype
        self.device = first.device
        self.num_blocks = int(first.shape[0])
        self.groups = self._group(self.layers) if layout.affine else [self._table_group(i) for i in range(len(layers))]
        # CPU caches: the layers are split over ``threads`` threads (torch copies drop the
        # GIL); a CUDA cache's copies are kernels on one stream, issued from one thread.
        self.threads = max(1, threads) if first.device.type == "cpu" else 1
        self.max_runs = self.MAX_RUNS_CPU if first.device.type == "cpu" else self.MAX_RUNS_CUDA
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _parts(self) -> list[tuple[_Group, int, int]]:
        """(group, first layer, end layer) pieces of the work, one per thread and group."""
        parts: list[tuple[_Group, int, int]] = []
        for g in self.groups:
            k = min(self.threads, g.count)
            bounds = [g.count * i // k for i in range(k + 1)]
            parts.extend((g, bounds[i], bounds[i + 1]) for i in range(k))
        return parts

    def _parallel(self, jobs: Sequence[Callable[[], Any]]) -> None:
        """Run ``jobs`` on the copier's own ``threads`` threads; re-raise the first error.

        CPU copies never run on the caller's thread: in vLLM's CPU worker that thread
        carries the engine's OpenMP setup, and torch copies issued from it stalled
        (a 28 MiB load took 63-657 ms from it, 33-39 ms from a copier thread)."""
        if self.device.type != "cpu":
            _run_all(jobs)
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="lmcache-paged")
        shares = [share for share in (jobs[i :: self.threads] for i in range(self.threads)) if share]
        # Inference mode is per thread: the helpers run in the caller's (vLLM runs the
        # model, and so creates the tensors copied here, under torch.inference_mode).
        inference = _torch().is_inference_mode_enabled()
        futures = [self._pool.submit(_run_all, share, inference) for share in shares]
        for future in futures:
            future.result()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    # -- views -------------------------------------------------------------------------------
    def _group(self, layers: list[Any]) -> list[_Group]:
        groups: list[_Group] = []
        i = 0
        while i < len(layers):
            j = i + 1
            step = None
            while j < len(layers) and _same_storage(layers[i], layers[j]):
                delta = layers[j].storage_offset() - layers[j - 1].storage_offset()
                if delta <= 0 or (step is not None and delta != step):
                    break
                step = delta
                j += 1
            groups.append(self._affine_group(i, j - i, step or 0))
            i = j
        return groups

    def _affine_group(self, first: int, count: int, layer_stride: int) -> _Group:
        torch = _torch()
        layer = self.layers[first]
        lay = self.layout
        assert lay.key is not None and lay.value is not None
        sb = layer.stride(0)
        views = []
        for a in (lay.key, lay.value):
            views.append(
                torch.as_strided(
                    layer,
                    (count, self.num_blocks, lay.block_tokens, lay.num_heads, lay.head_dim),
                    (layer_stride, sb, a.token, a.head, a.dim),
                    layer.storage_offset() + a.base,
                )
            )
        both = None
        k, v = lay.key, lay.value
        if (k.token, k.head, k.dim) == (v.token, v.head, v.dim) and v.base > k.base:
            both = torch.as_strided(
                layer,
                (count, self.num_blocks, lay.block_tokens, lay.num_heads, 2, lay.head_dim),
                (layer_stride, sb, k.token, k.head, v.base - k.base, k.dim),
                layer.storage_offset() + k.base,
            )
        return _Group(first, count, views[0], views[1], both=both)

    def _table_group(self, index: int) -> _Group:
        torch = _torch()
        layer = self.layers[index]
        sb = layer.stride(0)
        extent = 1 + sum((n - 1) * s for n, s in zip(layer.shape, layer.stride()))
        flat = torch.as_strided(layer, (extent,), (1,), layer.storage_offset())
        return _Group(index, 1, flat=flat, block_stride=sb)

    # -- copies ------------------------------------------------------------------------------
    def _runs(self, slots: Slots) -> list[tuple[int, int, int, int]] | None:
        """(kernel block, first offset, end offset, first token) per contiguous run,
        or None when there are more than ``max_runs``."""
        torch = _torch()
        blocks, offsets = slots.blocks, slots.offsets
        n = len(blocks)
        if n == 0:
            return []
        breaks = torch.nonzero((blocks[1:] != blocks[:-1]) | (offsets[1:] != offsets[:-1] + 1)).flatten() + 1
        if len(breaks) >= self.max_runs:
            return None
        starts = [0, *breaks.tolist()]
        ends = [*starts[1:], n]
        first_blocks, first_offsets = blocks[starts].tolist(), offsets[starts].tolist()
        return [(b, o, o + e - s, s) for b, o, s, e in zip(first_blocks, first_offsets, starts, ends)]

    def _on_device(self, tensor: Any) -> Any:
        return tensor if tensor.device == self.device else tensor.to(self.device, non_blocking=True)

    def gather(self, slots: Slots, out: Any) -> None:
        """Copy the tokens at ``slots`` of every layer into ``out`` ``(layers, 2, tokens, heads, dim)``.

        ``out`` may live elsewhere (a CPU pool slot for a CUDA cache): the tokens
        are then gathered on the cache's device first and moved in one copy."""
        if out.device != self.device:
            staging = self._empty(out.shape)
            self.gather(slots, staging)
            out.copy_(staging)
            return
        self._check(out, slots)
        runs = self._runs(slots) if self.layout.affine else None
        on_device = Slots(self._on_device(slots.blocks), self._on_device(slots.offsets))
        self._parallel([functools.partial(self._gather_part, part, on_device, runs, out) for part in self._parts()])

    def layer_plan(self, slots: Slots) -> tuple[Slots, Any]:
        """``slots`` on the cache's device and their block runs, for :meth:`gather_layer`
        (worked out once per token range, used for every layer)."""
        runs = self._runs(slots) if self.layout.affine else None
        return Slots(self._on_device(slots.blocks), self._on_device(slots.offsets)), runs

    def gather_layer(self, plan: tuple[Slots, Any], layer: int, dest: Any) -> None:
        """Copy the tokens of ``plan`` (:meth:`layer_plan`) of one layer into ``dest``
        ``(1, 2, tokens, heads, dim)`` on the cache's device, on the calling thread
        (layer-wise saves copy each layer as the forward pass finishes it)."""
        slots, runs = plan
        for g in self.groups:
            if g.first <= layer < g.first + g.count:
                i = layer - g.first
                self._gather_into(g, i, i + 1, slots, runs, dest)
                return
        raise IndexError(f"layer {layer} of a cache of {self.num_layers} layers")

    def _gather_part(self, part: tuple[_Group, int, int], slots: Slots, runs: Any, out: Any) -> None:
        g, lo, hi = part
        self._gather_into(g, lo, hi, slots, runs, out[g.first + lo : g.first + hi])

    def _gather_into(self, g: _Group, lo: int, hi: int, slots: Slots, runs: Any, dest: Any) -> None:
        if g.flat is not None:
            dest.copy_(self._take(g, slots))
        elif runs is not None and g.both is not None:
            for kb, o0, o1, t0 in runs:
                dest[:, :, t0 : t0 + o1 - o0].permute(0, 2, 3, 1, 4).copy_(g.both[lo:hi, kb, o0:o1])
        elif runs is not None:
            for kb, o0, o1, t0 in runs:
                for kv, view in enumerate((g.key, g.value)):
                    dest[:, kv, t0 : t0 + o1 - o0].copy_(view[lo:hi, kb, o0:o1])
        else:
            for kv, view in enumerate((g.key, g.value)):
                _index_into(view[lo:hi], slots.blocks, slots.offsets, dest[:, kv])

    def scatter(self, slots: Slots, src: Any) -> None:
        """Write ``src`` ``(layers, 2, tokens, heads, dim)`` into the tokens at ``slots``
        (through the engine's own cache write per layer when the copier has it)."""
        if src.device != self.device:
            src = src.to(self.device)  # blocking: the source may be a leased pool slot
        self._check(src, slots)
        on_device = Slots(self._on_device(slots.blocks), self._on_device(slots.offsets))
        if self.writers is not None:
            flat = (on_device.blocks * self.layout.block_tokens + on_device.offsets).long()
            jobs = [functools.partial(w, src[i, 0], src[i, 1], flat) for i, w in enumerate(self.writers)]
            self._parallel(jobs)
            return
        runs = self._runs(slots) if self.layout.affine else None
        self._parallel([functools.partial(self._scatter_part, part, on_device, runs, src) for part in self._parts()])

    def _scatter_part(self, part: tuple[_Group, int, int], slots: Slots, runs: Any, src: Any) -> None:
        g, lo, hi = part
        piece = src[g.first + lo : g.first + hi]
        if g.flat is not None:
            g.flat.index_copy_(0, self._table_index(g, slots).reshape(-1), piece.reshape(-1))
        elif runs is not None and g.both is not None:
            for kb, o0, o1, t0 in runs:
                g.both[lo:hi, kb, o0:o1].copy_(piece[:, :, t0 : t0 + o1 - o0].permute(0, 2, 3, 1, 4))
        elif runs is not None:
            for kb, o0, o1, t0 in runs:
                for kv, view in enumerate((g.key, g.value)):
                    view[lo:hi, kb, o0:o1].copy_(piece[:, kv, t0 : t0 + o1 - o0])
        else:
            for kv, view in enumerate((g.key, g.value)):
                view[lo:hi, slots.blocks, slots.offsets] = piece[:, kv]

    def _table_index(self, g: _Group, slots: Slots) -> Any:
        """Flat element index of every ``(kv, token, head, dim)`` at ``slots``: ``(2, T, H, D)``."""
        within = self.layout.positions.to(self.device)[:, slots.offsets]  # (2, T, H, D)
        return within + (slots.blocks * g.block_stride).view(1, -1, 1, 1)

    def _take(self, g: _Group, slots: Slots) -> Any:
        return g.flat[self._table_index(g, slots)].unsqueeze(0)

    def _empty(self, shape: Any) -> Any:
        return _torch().empty(shape, dtype=self.dtype, device=self.device)

    def _check(self, payload: Any, slots: Slots) -> None:
        want = (self.num_layers, 2, len(slots.blocks), self.layout.num_heads, self.layout.head_dim)
        if tuple(payload.shape) != want:
            raise ValueError(f"payload shape {tuple(payload.shape)}, expected {want}")
        if payload.dtype != self.dtype:
            raise ValueError(f"payload dtype {payload.dtype}, the cache holds {self.dtype}")
        if len(slots.blocks) and int(slots.blocks.max()) >= self.num_blocks:
            raise ValueError(f"kernel block {int(slots.blocks.max())} is past the cache's {self.num_blocks}")


def _run_all(jobs: Sequence[Callable[[], Any]], inference: bool | None = None) -> None:
    if inference is None:
        for job in jobs:
            job()
        return
    with _torch().inference_mode(inference):
        _run_all(jobs)


def _same_storage(a: Any, b: Any) -> bool:
    return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def _index_into(view: Any, blocks: Any, offsets: Any, out: Any) -> None:
    """``out[:] = view[:, blocks, offsets]``, written straight into ``out`` (one layer at
    a time where ``out`` is not contiguous as a whole)."""
    torch = _torch()
    if out.is_contiguous():
        torch.ops.aten.index.Tensor_out(view, [None, blocks, offsets], out=out)
        return
    for i in range(out.shape[0]):
        if out[i].is_contiguous():
            torch.ops.aten.index.Tensor_out(view[i], [blocks, offsets], out=out[i])
        else:
            out[i].copy_(view[i, blocks, offsets])
