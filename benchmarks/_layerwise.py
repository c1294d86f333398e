"""gpu_check.py's layer-wise section: a save copied out after the forward pass against
one copied out layer by layer during it (``layerwise_save``, integrations/vllm/worker/layerwise.py).

A synthetic forward pass over the paged cache of ``_batched`` (FlashAttention-shaped):
per layer, ``--layerwise-matmuls`` matmuls of ``(tokens, hidden) x (hidden, hidden)``
stand for the layer's compute, then the layer "writes" its cache.  Three timings, each
to the point where the save's bytes are in host memory:

``compute``    the forward pass alone (the floor);
``after``      the forward pass, then the step's save gathered from every layer
               (what the worker does without the setting: ``PagedCopier.gather``
               into page-locked host memory, then a synchronize);
``layerwise``  the forward pass with :class:`LayerwiseSaver` copying each layer as it
               ends (side stream, an event per layer), then waiting for the copies.

What layer-wise saves buy is ``(after - compute) / (layerwise - compute)``: how much
of the save's time the overlap hides.  The bytes are checked equal.  On a CPU
(``--paged-device cpu``) the same code runs, for a smoke test of the script.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from _batched import BLOCK, HEAD_DIM, HEADS, _flash_write


def measure_layerwise(
    device: str, layers: int, chunks: int, chunk_tokens: int, reps: int, hidden: int, matmuls: int
) -> list[dict[str, Any]]:
    """Rows ``{"path": "layerwise-<timing>", "ms", ...}`` and a printed summary."""
    import torch

    from lmcache_client.integrations import paged
    from lmcache_client.integrations.vllm.meta import SaveRequest
    from lmcache_client.integrations.vllm.worker.layerwise import LayerwiseSaver

    dtype = torch.float16 if device == "cuda" else torch.float32
    tokens = chunks * chunk_tokens
    n_blocks = 2 * tokens // BLOCK + 8
    raw = torch.randn(layers, n_blocks, BLOCK, HEADS, 2 * HEAD_DIM, device=device).to(dtype)
    caches = [raw[i].permute(0, 2, 1, 3) for i in range(layers)]
    layout = paged.probe_block_layout(
        _flash_write,
        block_tokens=BLOCK,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        content=2 * HEAD_DIM,
        strides=caches[0].stride()[1:],
        dtype=dtype,
    )
    copier = paged.PagedCopier(caches, layout)
    block_ids = random.Random(0).sample(range(n_blocks), tokens // BLOCK)
    slots = paged.token_slots(block_ids, 0, tokens, BLOCK)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    shape = (layers, 2, chunk_tokens, HEADS, HEAD_DIM)
    saver = LayerwiseSaver(copier, names, shape, 4 * layers * 2 * tokens * HEADS * HEAD_DIM * 4)
    request = SaveRequest("r", [bytes(32)] * chunks, 0, block_ids)
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    weights = [torch.randn(hidden, hidden, device=device).to(dtype) / hidden**0.5 for _ in range(matmuls)]
    after_out = torch.empty((layers, 2, tokens, HEADS, HEAD_DIM), dtype=dtype, pin_memory=device == "cuda")
    got: list[Any] = []

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def layer_compute() -> None:
        h = x
        for w in weights:
            h = h @ w

    def compute() -> None:
        for _ in names:
            layer_compute()
        sync()

    def after() -> None:
        for _ in names:
            layer_compute()
        copier.gather(slots, after_out)
        sync()

    def layerwise() -> None:
        step = object()
        for name in names:
            layer_compute()
            saver.layer(step, [request], lambda lo, hi, r: paged.token_slots(block_ids, lo, hi, BLOCK), name)
        [staged] = saver.end(step)
        assert staged is not None and staged.wait(), "every layer copied"
        got[:] = [staged.chunk(i, chunk_tokens).clone() for i in range(chunks)]
        staged.release()
        sync()

    measured: dict[str, float] = {}
    for name, fn in (("compute", compute), ("after", after), ("layerwise", layerwise)):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        measured[name] = statistics.median(times)
    saver.close()
    for i in range(chunks):  # the layer-wise copies hold what the gather after the pass holds
        if not torch.equal(got[i], after_out[:, :, i * chunk_tokens : (i + 1) * chunk_tokens]):
            raise AssertionError(f"layer-wise chunk {i} differs from the gathered one")
    c = measured["compute"]
    save_after, save_lw = measured["after"] - c, measured["layerwise"] - c
    hidden_share = 1 - save_lw / save_after if save_after > 0 else 0.0
    print(
        f"layerwise {device} {layers} layers, {chunks} chunks x {chunk_tokens} tokens, compute "
        f"{c * 1e3:.2f} ms: the save adds {save_after * 1e3:.2f} ms after the pass, "
        f"{save_lw * 1e3:.2f} ms layer by layer ({hidden_share * 100:.0f}% of it hidden)",
        flush=True,
    )
    return [
        {"path": f"layerwise-{name}", "layers": layers, "chunks": chunks, "chunk_tokens": chunk_tokens,
         "hidden": hidden, "matmuls": matmuls, "ms": round(s * 1e3, 3)}
        for name, s in measured.items()
    ]  # fmt: skip
