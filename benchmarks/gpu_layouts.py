"""GPU check of the vLLM connector's paged layouts: probe, gather and scatter on CUDA caches.

Run on a host with a CUDA GPU and a CUDA build of torch (and, to check against
vLLM's own cache op, a GPU build of vLLM):

    python benchmarks/gpu_layouts.py [--json out.json] [--device cuda|cpu]

Per KV layout vLLM's FlashAttention-style backends use (FlashAttention,
FlashInfer: ``K || V`` per token, written by ``reshape_and_cache_flash`` after
``cache.transpose(1, 2).split(head_size, -1)``) in the stride orders vLLM 0.32
allocates, NHD (``LBNHC``), HND (``LBHNC``) and block-outermost (``BLHNC``,
layers interleaved inside each block), for fp16 and bf16, it:

1. builds per-layer cache views of a raw buffer as vLLM does (one storage,
   logical ``(blocks, heads, block_tokens, 2 * head_dim)``);
2. probes the layout with the cache write (vLLM's ``reshape_and_cache_flash``
   when importable, else a torch stand-in of it) and checks it is the affine
   layout expected;
3. writes random K/V through the cache write, gathers them back with
   ``PagedCopier`` into pinned host memory (what a store into the daemon's
   pool does) and scatters them into a fresh cache (a load), checking every
   element against the engine's own write;
4. times gather (device to host) and scatter (host to device) of 8 chunks of
   256 tokens against plain pinned-memory copies of the same bytes.

Without a GPU it says why, writes ``{"available": false, "reason": ...}``
when asked for JSON, and exits 0; ``--device cpu`` runs the same checks on
CPU tensors with the stand-in (what the test suite does to keep this script
working).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYOUTS = {"NHD (LBNHC)": (0, 1, 3, 2, 4), "HND (LBHNC)": (0, 1, 2, 3, 4), "block-outermost (BLHNC)": (1, 0, 2, 3, 4)}
LAYERS, HEADS, DIM, BLOCK, CHUNK, BATCH = 32, 8, 128, 16, 256, 8  # Llama-3-8B, 8 chunks of 32 MiB (bf16)


def unavailable_reason(device: str) -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if device == "cuda" and not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (CPU build, no driver, or no GPU)"
    return None


def cache_write() -> tuple[Callable[..., None], str]:
    """vLLM's flash cache write, or the stand-in of tests/integrations/vllm/vllm_harness/standins.py."""
    try:
        import torch
        import vllm._custom_ops  # noqa: F401 - registers _C_cache_ops

        op = torch.ops._C_cache_ops.reshape_and_cache_flash

        def write(key: Any, value: Any, cache: Any, slots: Any) -> None:
            kc, vc = cache.transpose(1, 2).split(key.shape[-1], dim=-1)
            one = torch.tensor(1.0, device=cache.device)
            op(key, value, kc, vc, slots, "auto", one, one)

        return write, "vLLM reshape_and_cache_flash"
    except (ImportError, AttributeError, RuntimeError):
        from tests.integrations.vllm.vllm_harness.standins import flash_write

        return flash_write, "torch stand-in of reshape_and_cache_flash"


def layer_views(order: tuple[int, ...], blocks: int, dtype: Any, device: str) -> list[Any]:
    """Per-layer logical (B, H, N, C) views of one raw buffer in ``order`` (vLLM's stride permutation)."""
    import torch

    logical = (LAYERS, blocks, HEADS, BLOCK, 2 * DIM)
    physical = tuple(logical[i] for i in order)
    raw = torch.zeros(physical, dtype=dtype, device=device)
    view = raw.permute(*[order.index(i) for i in range(5)])
    return [view[i] for i in range(LAYERS)]


def timed(fn: Callable[[], None], sync: Callable[[], None], reps: int = 9) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check_layout(name: str, order: tuple[int, ...], dtype: Any, device: str, write: Any) -> dict[str, Any]:
    import torch

    from lmcache_client.integrations.paged import PagedCopier, probe_block_layout, token_slots

    blocks = 2 * BATCH * CHUNK // BLOCK + 4
    caches = layer_views(order, blocks, dtype, device)
    layout = probe_block_layout(
        write,
        block_tokens=BLOCK,
        num_heads=HEADS,
        head_dim=DIM,
        content=2 * DIM,
        strides=caches[0].stride()[1:],
        dtype=dtype,
        device=device,
    )
    first = caches[0]
    assert layout.key is not None and layout.value is not None, f"{name}: not affine ({layout.description})"
    assert (layout.key.token, layout.key.head, layout.key.dim) == (first.stride(2), first.stride(1), 1), name
    assert layout.value.base - layout.key.base == DIM, name
    tokens = BATCH * CHUNK
    block_ids = torch.randperm(blocks - 4)[: tokens // BLOCK].tolist()
    slots = token_slots(block_ids, 0, tokens, BLOCK)
    g = torch.Generator(device=device).manual_seed(0)
    payload = torch.randn((LAYERS, 2, tokens, HEADS, DIM), generator=g, device=device).to(dtype)
    flat = (slots.blocks * BLOCK + slots.offsets).to(device)
    for i, layer in enumerate(caches):
        write(payload[i, 0], payload[i, 1], layer, flat)
    copier = PagedCopier(caches, layout)
    pinned = device == "cuda"
    out = torch.empty(payload.shape, dtype=dtype, pin_memory=pinned)
    copier.gather(slots, out)
    assert torch.equal(out.to(device), payload), f"{name}: gather differs from the engine's write"
    fresh = layer_views(order, blocks, dtype, device)
    PagedCopier(fresh, layout).scatter(slots, out)
    assert all(torch.equal(a, b) for a, b in zip(fresh, caches)), f"{name}: scatter differs from the engine's write"

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    nbytes = payload.numel() * payload.element_size()
    device_copy = payload.clone()
    gather_s = timed(lambda: copier.gather(slots, out), sync)
    scatter_s = timed(lambda: PagedCopier(fresh, layout).scatter(slots, out), sync)
    d2h_s = timed(lambda: out.copy_(device_copy), sync)
    h2d_s = timed(lambda: device_copy.copy_(out), sync)
    row = {
        "layout": name,
        "dtype": str(dtype).removeprefix("torch."),
        "probe": layout.description,
        "gather_gib_s": nbytes / gather_s / 2**30,
        "scatter_gib_s": nbytes / scatter_s / 2**30,
        "plain_d2h_gib_s": nbytes / d2h_s / 2**30,
        "plain_h2d_gib_s": nbytes / h2d_s / 2**30,
    }
    copier.close()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    reason = unavailable_reason(args.device)
    if reason is not None:
        print(f"gpu_layouts: nothing to check here: {reason}")
        if args.json:
            args.json.write_text(json.dumps({"available": False, "reason": reason}))
        return 0
    import torch

    global LAYERS, BATCH
    if args.device == "cpu":  # the stand-in writes token by token in Python: a smaller model
        LAYERS, BATCH = 4, 1
    write, source = cache_write() if args.device == "cuda" else _stand_in()
    print(f"cache write: {source}; device: {args.device}")
    rows = []
    for name, order in LAYOUTS.items():
        for dtype in (torch.float16, torch.bfloat16):
            rows.append(check_layout(name, order, dtype, args.device, write))
            r = rows[-1]
            print(
                f"{name:>24} {r['dtype']:>8}: {r['probe']}; gather {r['gather_gib_s']:.1f} GiB/s "
                f"(plain d2h {r['plain_d2h_gib_s']:.1f}, {r['gather_gib_s'] / r['plain_d2h_gib_s']:.2f}x), "
                f"scatter {r['scatter_gib_s']:.1f} GiB/s (plain h2d {r['plain_h2d_gib_s']:.1f}, "
                f"{r['scatter_gib_s'] / r['plain_h2d_gib_s']:.2f}x)"
            )
    print("every layout read back exactly: probe, gather and scatter agree with the engine's write")
    if args.json:
        args.json.write_text(json.dumps({"available": True, "write": source, "device": args.device, "rows": rows}))
    return 0


def _stand_in() -> tuple[Callable[..., None], str]:
    from tests.integrations.vllm.vllm_harness.standins import flash_write

    return flash_write, "torch stand-in of reshape_and_cache_flash"


if __name__ == "__main__":
    sys.exit(main())
