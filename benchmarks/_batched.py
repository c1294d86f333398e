"""gpu_check.py's paged-copy section: chunk-by-chunk against batched copies (integrations/batched.py).

A synthetic paged cache shaped like a FlashAttention one (token-major blocks,
``K || V`` per token, every layer in one storage), a request's blocks in random
order, and one page-locked host payload per chunk (the shared pool's slots are
page-locked the same way; gpu_check's shm rows measure those).  Per direction:

``per-chunk``  what the worker does today: one ``PagedCopier`` call per chunk
               (a host-to-device copy and the indexed copies of that chunk),
               then a synchronize;
``batched``    one :class:`BatchedCopies` call for all the chunks: staged along
               the token axis on the side stream, one indexed copy per layer
               group and K/V, completion by its event.

Both write (and read back) the same bytes, which is checked.  On a CPU
(``--paged-device cpu``) the same code runs, for a smoke test of the script.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

HEADS, HEAD_DIM, BLOCK = 8, 128, 16


def _flash_write(key: Any, value: Any, cache: Any, slots: Any) -> None:
    """A FlashAttention-style cache write (``cache`` logical (blocks, heads, tokens, 2D))."""
    rows = cache.transpose(1, 2)  # (blocks, tokens, heads, 2D)
    n = cache.shape[2]
    b, o = slots // n, slots % n
    rows[b, o, :, : key.shape[-1]] = key
    rows[b, o, :, key.shape[-1] :] = value


def _timed(fn: Callable[[], None], reps: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_paged(device: str, layers: int, chunks: int, chunk_tokens: int, reps: int) -> list[dict[str, Any]]:
    """Rows ``{"path", "direction", "chunks", "chunk_tokens", "ms", "gib_per_s"}`` and a printed summary."""
    import torch

    from lmcache_client.integrations import paged
    from lmcache_client.integrations.batched import BatchedCopies, Part

    dtype = torch.float16
    tokens = chunks * chunk_tokens
    n_blocks = 2 * tokens // BLOCK + 8
    raw = torch.zeros(layers, n_blocks, BLOCK, HEADS, 2 * HEAD_DIM, dtype=dtype, device=device)
    caches = [raw[i].permute(0, 2, 1, 3) for i in range(layers)]
    probe_cache = raw[0].permute(0, 2, 1, 3)
    layout = paged.probe_block_layout(
        _flash_write,
        block_tokens=BLOCK,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        content=2 * HEAD_DIM,
        strides=probe_cache.stride()[1:],
        dtype=dtype,
    )
    copier = paged.PagedCopier(caches, layout)
    batched = BatchedCopies(copier)
    block_ids = random.Random(0).sample(range(n_blocks), tokens // BLOCK)
    pin = device == "cuda"
    parts = []
    g = torch.Generator().manual_seed(0)
    for c in range(chunks):
        slots = paged.token_slots(block_ids, c * chunk_tokens, (c + 1) * chunk_tokens, BLOCK)
        payload = torch.randn(layers, 2, chunk_tokens, HEADS, HEAD_DIM, generator=g).to(dtype)
        parts.append(Part(slots, payload.pin_memory() if pin else payload))
    outs = [Part(p.slots, torch.empty_like(p.payload, pin_memory=pin)) for p in parts]

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def load_per_chunk() -> None:
        for part in parts:
            copier.scatter(part.slots, part.payload)

    def load_batched() -> None:
        batched.scatter(parts).wait()

    def save_per_chunk() -> None:
        for out in outs:
            copier.gather(out.slots, out.payload)

    def save_batched() -> None:
        batched.gather(outs).wait()

    nbytes = sum(p.payload.nelement() * p.payload.element_size() for p in parts)
    rows: list[dict[str, Any]] = []
    measured: dict[tuple[str, str], float] = {}
    for direction, fns in (("h2d", (load_per_chunk, load_batched)), ("d2h", (save_per_chunk, save_batched))):
        for path, fn in zip(("per-chunk", "batched"), fns):
            raw.zero_()
            if direction == "d2h":
                load_batched()
            seconds = _timed(fn, reps, sync)
            measured[(path, direction)] = seconds
            rows.append({"path": f"paged-{path}", "direction": direction, "chunks": chunks,
                         "chunk_tokens": chunk_tokens, "layers": layers, "ms": round(seconds * 1e3, 3),
                         "gib_per_s": round(nbytes / seconds / 1024**3, 2)})  # fmt: skip
            # Bytes: a load leaves every chunk's payload in the cache; a save reads it back.
            for part, out in zip(parts, outs):
                check = torch.empty_like(part.payload)
                if direction == "h2d":
                    copier.gather(part.slots, check)
                    if not torch.equal(check, part.payload):
                        raise AssertionError(f"{path} load wrote other bytes")
                elif not torch.equal(out.payload, part.payload):
                    raise AssertionError(f"{path} save read other bytes")
    for direction in ("h2d", "d2h"):
        one, many = measured[("per-chunk", direction)], measured[("batched", direction)]
        print(f"paged {device} {direction} {chunks} chunks x {chunk_tokens} tokens x {layers} layers: "
              f"per-chunk {one * 1e3:8.2f} ms, batched {many * 1e3:8.2f} ms ({one / many:.2f}x); "
              f"launches per batch: 1 copier call, per-chunk: {chunks}", flush=True)  # fmt: skip
    return rows
