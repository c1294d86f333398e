"""Batched copies (integrations/batched.py, issue 30 items 1 and 10): a batch of chunks
moves through one copier call per direction, and writes and reads exactly the bytes of
the per-chunk path.  On CPU tensors, over random layouts (the stand-in engine writes of
test_paged_layout.py: the CPU backend's transposed K, FlashAttention's K || V per token,
a swizzled position-table layout), dtypes, block sizes, chunk splits and batch bounds.
The CUDA side (side stream, events) is the same code; benchmarks/gpu_check.py runs it
on a GPU."""

from __future__ import annotations

import random
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lmcache_client.integrations import paged  # noqa: E402
from lmcache_client.integrations.batched import BatchedCopies, Completion, Part  # noqa: E402

from .test_paged_layout import D, H, head_major, probe, token_major  # noqa: E402
from .vllm.vllm_harness.standins import cpu_write, flash_write, swizzled_write  # noqa: E402

SHAPES = [
    (cpu_write, head_major, 16, 16),
    (cpu_write, head_major, 32, 16),  # scheduler blocks of two kernel blocks
    (flash_write, token_major, 1, 1),  # many runs: the indexed path
    (flash_write, token_major, 4, 4),
    (flash_write, head_major, 8, 8),
    (swizzled_write, head_major, 8, 8),  # position table
]


def caches(make: Any, blocks: int, kernel: int, dtype: Any, layers: int, shared: bool) -> list[Any]:
    return make(blocks, kernel, dtype, layers) if shared else [make(blocks, kernel, dtype)[0] for _ in range(layers)]


def random_case(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    write, make, block_size, kernel = rng.choice(SHAPES)
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    layers, kernel_blocks = rng.choice([1, 2, 3]), 160
    shared = rng.random() < 0.5
    start = rng.randrange(0, 12)
    end = start + rng.randrange(1, 120)
    block_ids = rng.sample(range(kernel_blocks * kernel // block_size), -(-end // block_size))
    chunk = rng.choice([4, 8, 16, 32])
    bounds = sorted({start, end, *range((start // chunk + 1) * chunk, end, chunk)})
    parts = []
    g = torch.Generator().manual_seed(seed)
    for lo, hi in zip(bounds, bounds[1:]):
        slots = paged.token_slots(block_ids, lo, hi, block_size, kernel)
        parts.append(Part(slots, torch.randn(layers, 2, hi - lo, H, D, generator=g).to(dtype)))
    return {
        "write": write,
        "make": make,
        "kernel": kernel,
        "dtype": dtype,
        "layers": layers,
        "blocks": kernel_blocks,
        "shared": shared,
        "parts": parts,
        "max_tokens": rng.choice([1, 7, 32, 1 << 16]),
        "writers": write is cpu_write and rng.random() < 0.5,
    }


def copier_for(case: dict[str, Any], layout: Any = None) -> tuple[paged.PagedCopier, list[Any]]:
    layers = caches(case["make"], case["blocks"], case["kernel"], case["dtype"], case["layers"], case["shared"])
    layout = layout or probe(case["write"], layers[0])
    writers = None
    if case["writers"]:
        write = case["write"]
        writers = [lambda k, v, slots, layer=layer: write(k, v, layer, slots) for layer in layers]
    return paged.PagedCopier(layers, layout, writers), layers


@pytest.mark.parametrize("seed", range(24))
def test_a_batch_writes_and_reads_the_bytes_of_the_per_chunk_path(seed: int) -> None:
    case = random_case(seed)
    parts: list[Part] = case["parts"]
    one, one_layers = copier_for(case)
    for part in parts:  # the per-chunk path
        one.scatter(part.slots, part.payload)
    batched, batched_layers = copier_for(case, one.layout)
    copies = BatchedCopies(batched, max_tokens=case["max_tokens"])
    done = copies.scatter(parts)
    assert isinstance(done, Completion) and done.done()
    for mine, theirs in zip(batched_layers, one_layers):
        assert torch.equal(mine, theirs), "the batch wrote other bytes than chunk by chunk"
    # One copier call per batch: as many as max_tokens splits the parts into, never one per chunk.
    total = sum(p.tokens for p in parts)
    if case["max_tokens"] >= total:
        assert copies.launches == 1
    else:
        assert 1 <= copies.launches <= len(parts)
    # Saves: gather the batch back into fresh payloads; the bytes are the per-chunk gather's.
    outs = [Part(p.slots, torch.empty_like(p.payload)) for p in parts]
    copies.gather(outs).wait()
    for part, out in zip(parts, outs):
        ref = torch.empty_like(part.payload)
        one.gather(part.slots, ref)
        assert torch.equal(out.payload, ref) and torch.equal(out.payload, part.payload)


def test_bad_parts_are_refused_before_anything_is_copied() -> None:
    case = random_case(3)
    copier, layers = copier_for(case)
    before = [layer.clone() for layer in layers]
    good = case["parts"][0]
    wrong_dtype = torch.float64 if good.payload.dtype != torch.float64 else torch.float32
    copies = BatchedCopies(copier)
    with pytest.raises(ValueError, match="dtype"):
        copies.scatter([Part(good.slots, good.payload.to(wrong_dtype))])
    with pytest.raises(ValueError, match="shape"):
        copies.scatter([Part(good.slots, good.payload[:, :, :0])])
    assert all(torch.equal(a, b) for a, b in zip(layers, before))
    with pytest.raises(ValueError, match="max_tokens"):
        BatchedCopies(copier, max_tokens=0)
    assert copies.scatter([]).done() and copies.launches == 0


def test_gpu_check_runs_its_paged_section_on_cpu(tmp_path: Any) -> None:
    """benchmarks/gpu_check.py --paged-device cpu: the batched-vs-per-chunk section and the
    layer-wise one on CPU tensors (their byte checks included) exit 0 with every path's rows."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
    out = tmp_path / "paged.json"
    args = ["--paged-device", "cpu", "--paged-layers", "2", "--paged-chunks", "3", "--paged-chunk-tokens", "32"]
    args += ["--layerwise-hidden", "64"]
    done = subprocess.run(
        [sys.executable, str(script), *args, "--reps", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["available"] and result["device"] == "cpu"
    paths = [r["path"] for r in result["rows"]]
    assert paths[4:] == ["layerwise-compute", "layerwise-after", "layerwise-layerwise"]
    assert sorted((r["path"], r["direction"]) for r in result["rows"][:4]) == [
        ("paged-batched", "d2h"),
        ("paged-batched", "h2d"),
        ("paged-per-chunk", "d2h"),
        ("paged-per-chunk", "h2d"),
    ]
    assert "batched" in done.stdout and "per-chunk" in done.stdout and "layer by layer" in done.stdout
