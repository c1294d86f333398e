"""Paged KV layouts: probing a cache write, and copying token ranges through what it found.

The writers here are stand-ins written from reading vLLM 0.32's backends (its
CPU backend's transposed K, FlashAttention's ``K || V`` per token in NHD and
HND block order) plus a swizzled layout no backend uses, to reach the
position-table path; they test our reading, not vLLM.  vLLM's own CPU cache
write is probed in tests/integrations/vllm/test_vllm_real.py, inside real vLLM.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lmcache_client.integrations import paged  # noqa: E402

from .vllm.vllm_harness.standins import cpu_write, flash_write, swizzled_write  # noqa: E402

H, D = 3, 8


def head_major(blocks: int, n_tok: int, dtype: Any, layers: int = 1) -> list[Any]:
    """Layer caches (blocks, H, N, 2D) contiguous (LBHNC), sharing one storage."""
    raw = torch.full((layers, blocks, H, n_tok, 2 * D), -7.0).to(dtype)
    return [raw[i] for i in range(layers)]


def token_major(blocks: int, n_tok: int, dtype: Any, layers: int = 1) -> list[Any]:
    """Layer caches with NHD block interiors (LBNHC): logical (B, H, N, C), H inside N."""
    raw = torch.full((layers, blocks, n_tok, H, 2 * D), -7.0).to(dtype)
    return [raw[i].permute(0, 2, 1, 3) for i in range(layers)]


def probe(write: Any, cache: Any) -> paged.BlockLayout:
    return paged.probe_block_layout(
        write,
        block_tokens=cache.shape[2],
        num_heads=H,
        head_dim=D,
        content=cache.shape[3],
        strides=cache.stride()[1:],
        dtype=cache.dtype,
    )


def test_probe_reads_the_cpu_backends_transposed_key() -> None:
    layout = probe(cpu_write, head_major(2, 16, torch.float32)[0])
    n, c = 16, 2 * D
    assert layout.key == paged.Affine(base=0, token=1, head=n * c, dim=n)
    assert layout.value == paged.Affine(base=n * D, token=D, head=n * c, dim=1)


@pytest.mark.parametrize("make", [head_major, token_major])
def test_probe_reads_flash_attention_layouts(make: Any) -> None:
    cache = make(2, 4, torch.float32)[0]
    layout = probe(flash_write, cache)
    assert layout.affine
    assert layout.key is not None and layout.value is not None
    assert layout.value.base - layout.key.base == D and layout.key.dim == 1
    assert layout.key.token == cache.stride(2) and layout.key.head == cache.stride(1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_probe_in_narrow_dtypes_takes_several_passes(dtype: Any) -> None:
    # 2 x 128 tokens x 3 heads x 8 = 6144 indices: 2 bf16 passes of 8 bits
    layout = probe(cpu_write, head_major(1, 128, dtype)[0])
    assert layout.key == paged.Affine(0, 1, 128 * 2 * D, 128)


def test_probe_keeps_a_table_for_a_layout_that_is_not_affine() -> None:
    layout = probe(swizzled_write, head_major(1, 8, torch.float32)[0])
    assert not layout.affine and layout.positions.shape == (2, 8, H, D)


def test_probe_refuses_a_write_that_misses_elements() -> None:
    def keys_only(key: Any, value: Any, cache: Any, slots: Any) -> None:
        flash_write(key, torch.full_like(value, -1), cache, slots)

    with pytest.raises(paged.LayoutError, match="exactly once"):
        probe(keys_only, head_major(1, 4, torch.float32)[0])
    with pytest.raises(paged.LayoutError, match="exactly once"):
        probe(lambda *args: None, head_major(1, 4, torch.float32)[0])


# -- copies through the probed layout ----------------------------------------------------------
def written_by_engine(write: Any, layers: list[Any], slots: paged.Slots, tokens: int, dtype: Any) -> Any:
    """Fill ``slots`` of every layer with random K/V through the engine write; returns the
    payload ``(layers, 2, tokens, H, D)`` that was written."""
    g = torch.Generator().manual_seed(tokens)
    payload = torch.randn(len(layers), 2, tokens, H, D, generator=g).to(dtype)
    n_tok = layers[0].shape[2]
    flat_slots = slots.blocks * n_tok + slots.offsets
    for i, layer in enumerate(layers):
        write(payload[i, 0], payload[i, 1], layer, flat_slots)
    return payload


CASES = [
    # write, cache maker, block_size (scheduler), kernel block, tokens [start, end)
    (cpu_write, head_major, 16, 16, 0, 48),
    (cpu_write, head_major, 16, 16, 5, 37),  # starts and ends inside blocks
    (cpu_write, head_major, 32, 16, 3, 61),  # scheduler blocks split into two kernel blocks
    (flash_write, token_major, 1, 1, 1, 80),  # more block runs than max_runs: the indexed path
    (flash_write, head_major, 4, 4, 0, 16),
    (swizzled_write, head_major, 8, 8, 2, 21),  # position table
]


@pytest.mark.parametrize("shared", [True, False], ids=["one-storage", "own-storage"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("write", "make", "block_size", "kernel", "start", "end"), CASES)
def test_gather_returns_what_the_engine_wrote_and_scatter_writes_it_back(
    write: Any, make: Any, block_size: int, kernel: int, start: int, end: int, dtype: Any, shared: bool
) -> None:
    layers_n, kernel_blocks = 3, 100
    layers = (
        make(kernel_blocks, kernel, dtype, layers_n)
        if shared
        else [make(kernel_blocks, kernel, dtype)[0] for _ in range(layers_n)]
    )
    block_ids = random.Random(end).sample(range(kernel_blocks * kernel // block_size), -(-end // block_size))
    slots = paged.token_slots(block_ids, start, end, block_size, kernel)
    payload = written_by_engine(write, layers, slots, end - start, dtype)
    copier = paged.PagedCopier(layers, probe(write, layers[0]))
    if shared and make is not token_major:
        assert len(copier.groups) == 1 or not copier.layout.affine, "layers of one storage are one 5-D view"

    out = torch.empty_like(payload)
    copier.gather(slots, out)
    assert torch.equal(out, payload)

    fresh = (
        make(kernel_blocks, kernel, dtype, layers_n)
        if shared
        else [make(kernel_blocks, kernel, dtype)[0] for _ in range(layers_n)]
    )
    paged.PagedCopier(fresh, copier.layout).scatter(slots, payload)
    for mine, theirs in zip(fresh, layers):
        assert torch.equal(mine, theirs), "scatter wrote other elements than the engine's own write"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_through_the_engines_own_write(dtype: Any) -> None:
    layers = head_major(12, 16, dtype, 2)
    slots = paged.token_slots([3, 9, 1], 5, 40, 16)
    payload = written_by_engine(cpu_write, layers, slots, 35, dtype)
    fresh = head_major(12, 16, dtype, 2)
    writes = [lambda k, v, s, layer=layer: cpu_write(k, v, layer, s) for layer in fresh]
    paged.PagedCopier(fresh, probe(cpu_write, fresh[0]), writes).scatter(slots, payload)
    assert all(torch.equal(a, b) for a, b in zip(fresh, layers))
    with pytest.raises(paged.LayoutError, match="cache writes"):
        paged.PagedCopier(fresh, probe(cpu_write, fresh[0]), writes[:1])


def test_copies_split_over_threads_keep_the_callers_inference_mode() -> None:
    """vLLM runs under torch.inference_mode (thread-local): tensors made there may be
    updated in place only in inference mode, so the copy threads must enter it too."""
    with torch.inference_mode():
        layers = head_major(8, 16, torch.float16, 4)
        slots = paged.token_slots([1, 5, 2], 0, 48, 16)
        payload = written_by_engine(cpu_write, layers, slots, 48, torch.float16)
        copier = paged.PagedCopier(layers, probe(cpu_write, layers[0]), threads=2)
        out = torch.empty_like(payload)
        copier.gather(slots, out)
        copier.scatter(slots, out)
    assert torch.equal(out, payload)
    copier.close()


def test_token_slots_maps_scheduler_blocks_to_kernel_blocks() -> None:
    slots = paged.token_slots([7, 2], 6, 10, block_size=8, block_tokens=4)
    # token 6: 2nd kernel block of block 7 (7*2+1), offset 2; token 8: 1st of block 2
    assert slots.blocks.tolist() == [15, 15, 4, 4]
    assert slots.offsets.tolist() == [2, 3, 0, 1]
    with pytest.raises(ValueError, match="past the request"):
        paged.token_slots([7, 2], 0, 17, 8)
    with pytest.raises(paged.LayoutError, match="do not divide"):
        paged.token_slots([7, 2], 0, 4, 8, 3)
    assert paged.blocks_covering([5, 1, 7, 0, 3], 6, 13, 4) == [1, 7, 0]


def test_copier_checks_payload_shape_dtype_and_blocks() -> None:
    layers = head_major(4, 4, torch.float32, 2)
    copier = paged.PagedCopier(layers, probe(cpu_write, layers[0]))
    slots = paged.token_slots([0, 1], 0, 8, 4)
    with pytest.raises(ValueError, match="payload shape"):
        copier.gather(slots, torch.empty(2, 2, 7, H, D))
    with pytest.raises(ValueError, match="dtype"):
        copier.gather(slots, torch.empty(2, 2, 8, H, D, dtype=torch.float16))
    with pytest.raises(ValueError, match="past the cache"):
        copier.gather(paged.token_slots([0, 9], 0, 8, 4), torch.empty(2, 2, 8, H, D))
    with pytest.raises(paged.LayoutError, match="differ"):
        paged.PagedCopier([layers[0], torch.zeros(4, H, 8, 2 * D)], copier.layout)


def test_the_gpu_layout_check_runs_and_says_why_without_a_gpu(tmp_path: Any) -> None:
    """benchmarks/gpu_layouts.py is the one device run that checks the CUDA layouts;
    here it must exit 0 saying why, and pass its own checks on CPU tensors."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_layouts.py"
    for device in ("cuda", "cpu"):
        out = tmp_path / f"{device}.json"
        done = subprocess.run(
            [sys.executable, str(script), "--device", device, "--json", str(out)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        result = json.loads(out.read_text())
        if device == "cpu" or torch.cuda.is_available():
            assert result["available"] and len(result["rows"]) == 6, done.stdout
            assert "read back exactly" in done.stdout
        else:
            assert not result["available"] and "CUDA" in result["reason"]
