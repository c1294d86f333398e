"""Batched copies between a paged KV cache and many chunk payloads at once.

Chunk by chunk, :class:`~.paged.PagedCopier` runs one copy (or one indexed
copy) per layer group, per K and V, per chunk: a load of ``N`` chunks is ``N``
times the launches, and on a GPU each is a kernel launch plus a host-to-device
copy of its own.  :class:`BatchedCopies` copies a *batch* of chunks in one go:

- their token slots are joined into one index, and their payloads
  ``(layers, 2, tokens, heads, dim)`` are staged in one tensor on the cache's
  device along the token axis;
- one copier call moves the whole batch: one indexed copy per layer group per
  K/V (or one strided copy per run of blocks, or one engine write per layer
  where the copier has the engine's write), whatever the number of chunks.

Loads: each payload (a page-locked pool slot) is copied into its slice of
the staging tensor, then the batch is scattered into the cache.  Saves: the
batch is gathered into the staging tensor, then each slice is copied into its
payload (a reserved pool slot).

On CUDA every copy of a batch runs on the object's *side stream*, ordered
after an event of the caller's stream (the forward pass that wrote, or will
next read, the blocks); host copies are ``non_blocking`` (DMA from/to the
page-locked mapping).  Nothing synchronizes: :meth:`BatchedCopies.scatter` and
:meth:`BatchedCopies.gather` return a :class:`Completion` holding a CUDA event
and every tensor the copies use.  The caller releases the leases of the pool
slots (and, for a save, commits them) only once ``done()`` says the event has
completed (or after ``wait()``): until then the DMA may still read or write
those slots.  On a CPU cache the very same code runs synchronously (the
non_blocking flags are no-ops) and the completion is done at once, which is
how the tests prove, on CPU tensors, that a batch writes and reads exactly the
bytes of the per-chunk path.

``max_tokens`` bounds the staging tensor: a longer batch is split into several
(still one copier call each); its completion is that of the last one (a
stream runs in order).

Primitives: :class:`Part`, :class:`Completion`, :class:`BatchedCopies`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from .paged import PagedCopier, Slots


def _torch() -> Any:
    import torch

    return torch


@dataclasses.dataclass
class Part:
    """One chunk's share of a batch: the cache tokens at ``slots`` and their payload
    ``(layers, 2, tokens, heads, dim)`` (host or device memory, the cache's dtype)."""

    slots: Slots
    payload: Any

    @property
    def tokens(self) -> int:
        return len(self.slots.blocks)


class Completion:
    """The end of a batch's copies: a CUDA event (None: done already, on a CPU cache),
    and the tensors the copies use, kept alive until then."""

    def __init__(self, event: Any = None, keep: Sequence[Any] = ()):
        self.event = event
        self._keep: list[Any] = list(keep)

    def done(self) -> bool:
        """Whether every copy of the batch has completed (never blocks)."""
        if self.event is None or self.event.query():
            self._keep.clear()
            return True
        return False

    def wait(self) -> None:
        """Block until the copies have completed (only this batch's event, never the device)."""
        if self.event is not None:
            self.event.synchronize()
        self._keep.clear()


class BatchedCopies:
    """Batches of chunk copies through ``copier``; on CUDA on a side stream of their own."""

    DEFAULT_MAX_TOKENS = 1 << 16

    def __init__(self, copier: PagedCopier, *, stream: Any = None, max_tokens: int = DEFAULT_MAX_TOKENS):
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, not {max_tokens}")
        self.copier = copier
        self.max_tokens = max_tokens
        self.cuda = copier.device.type == "cuda"
        if stream is None and self.cuda:
            stream = _torch().cuda.Stream(device=copier.device)
        self.stream = stream
        """The side stream (None on a CPU cache)."""
        self.launches = 0
        """Copier calls made (one per batch, whatever its chunks): for the benchmark."""

    # -- loads -------------------------------------------------------------------------------
    def scatter(self, parts: Sequence[Part], *, after: Any = None) -> Completion:
        """Write each part's payload into its cache slots, a batch at a time.  ``after``: a
        CUDA event the copies wait for (None: the caller's current stream so far)."""
        keep: list[Any] = []
        event = None
        with self._on_stream(after):
            for batch in self._batches(parts):
                staging = self._staging(batch)
                t = 0
                for part in batch:
                    staging[:, :, t : t + part.tokens].copy_(part.payload, non_blocking=True)
                    t += part.tokens
                self.copier.scatter(_joined(batch), staging)
                self.launches += 1
                keep += [staging, *(p.payload for p in batch)]
            event = self._record()
        return Completion(event, keep)

    # -- saves -------------------------------------------------------------------------------
    def gather(self, parts: Sequence[Part], *, after: Any = None) -> Completion:
        """Read each part's cache slots into its payload, a batch at a time."""
        keep: list[Any] = []
        event = None
        with self._on_stream(after):
            for batch in self._batches(parts):
                staging = self._staging(batch)
                self.copier.gather(_joined(batch), staging)
                self.launches += 1
                t = 0
                for part in batch:
                    part.payload.copy_(staging[:, :, t : t + part.tokens], non_blocking=True)
                    t += part.tokens
                keep += [staging, *(p.payload for p in batch)]
            event = self._record()
        return Completion(event, keep)

    # -- helpers -----------------------------------------------------------------------------
    def _batches(self, parts: Sequence[Part]) -> Iterator[list[Part]]:
        batch: list[Part] = []
        tokens = 0
        for part in parts:
            if part.tokens == 0:
                continue
            if batch and tokens + part.tokens > self.max_tokens:
                yield batch
                batch, tokens = [], 0
            batch.append(part)
            tokens += part.tokens
        if batch:
            yield batch

    def _staging(self, batch: list[Part]) -> Any:
        copier = self.copier
        lay = copier.layout
        for part in batch:
            if part.payload.dtype != copier.dtype:
                raise ValueError(f"payload dtype {part.payload.dtype}, the cache holds {copier.dtype}")
            want = (copier.num_layers, 2, part.tokens, lay.num_heads, lay.head_dim)
            if tuple(part.payload.shape) != want:
                raise ValueError(f"payload shape {tuple(part.payload.shape)}, expected {want}")
        total = sum(p.tokens for p in batch)
        return copier._empty((copier.num_layers, 2, total, lay.num_heads, lay.head_dim))

    @contextlib.contextmanager
    def _on_stream(self, after: Any) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        torch = _torch()
        if after is not None:
            self.stream.wait_event(after)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.copier.device))
        with torch.cuda.stream(self.stream):
            yield

    def _record(self) -> Any:
        if self.stream is None:
            return None
        event = _torch().cuda.Event()
        event.record(self.stream)
        return event


def _joined(batch: list[Part]) -> Slots:
    torch = _torch()
    if len(batch) == 1:
        return batch[0].slots
    return Slots(torch.cat([p.slots.blocks for p in batch]), torch.cat([p.slots.offsets for p in batch]))
