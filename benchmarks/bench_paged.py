"""The vLLM adapter's paged store and retrieve against moving the same chunks contiguously.

``python benchmarks/bench_paged.py [--sizes 4,16,32] [--reps 7] [--json out.json]``
(``.venv-vllm/bin/python benchmarks/bench_paged.py`` probes and writes through
vLLM's own CPU cache op; the daemon runs from ``.venv``.)

Starts a daemon (shared-memory pool), then per chunk size (MiB) and per KV
layout measures, interleaved, in one run:

- **paged store**: the connector's worker side (``WorkerSide.save``) gathering
  8 chunks of 256 tokens out of a paged KV cache straight into the daemon's
  reserved pool slots and committing them;
- **paged retrieve**: ``WorkerSide.load`` scattering 8 stored chunks from the
  leased pool slots straight into the cache's blocks;
- **contiguous** put and get of the same 8 chunks from contiguous tensors with
  the same client and batching (``ChunkTransfer.put`` / ``get_prefix_into``):
  the baseline, one memcpy per chunk (split over the client's 2 copy threads).

Layouts: ``cpu`` is vLLM 0.32's CPU backend (K of each head transposed inside a
block, ``[head_dim, 128 tokens]``; probed from vLLM's own cache write when vLLM
is importable, else from the stand-in write of tests/integrations/test_paged_layout.py),
``nhd`` a FlashAttention-style ``K || V`` per token (on CPU tensors here).
Chunk sizes come from the model shapes: 4 MiB = 8 layers x 4 KV heads x 128
fp16; 16 MiB = 32 x 4 x 128 fp16; 32 MiB = 32 x 8 x 128 bf16 (Llama-3-8B).
torch runs one thread, as vLLM's CPU worker does.  Prints MiB/s (median of
``--reps``) and paged / contiguous.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import CpuMeter, free_port, measure_group, raise_on_sigterm, workspace  # noqa: E402

SHAPES = {4: (8, 4, 128, "float16"), 16: (32, 4, 128, "float16"), 32: (32, 8, 128, "bfloat16")}
CHUNK_TOKENS, BLOCK, BATCH = 256, 128, 8
DAEMON_PYTHON = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "python"
ENGINE_WRITE = True


def cpu_writer() -> tuple[Any, str]:
    try:
        import vllm._custom_ops as ops
        import vllm.platforms  # noqa: F401 - loads the CPU ops

        def write(key: Any, value: Any, cache: Any, slots: Any) -> None:
            n = cache.shape[2]
            kc, vc = cache.view(cache.shape[0], cache.shape[1], 2 * n, -1).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, "vec")

        return write, "vLLM's cpu_attn_reshape_and_cache"
    except ImportError:
        from tests.integrations.vllm.vllm_harness.standins import cpu_write

        return cpu_write, "stand-in of vLLM's CPU write (vLLM not importable)"


def nhd_write(key: Any, value: Any, cache: Any, slots: Any) -> None:
    from tests.integrations.vllm.vllm_harness.standins import flash_write

    flash_write(key, value, cache, slots)


def make_worker(size_mib: int, layout: str, client: Any, namespace: str) -> tuple[Any, Any, int]:
    import torch

    from lmcache_client.integrations.chunklayout import ChunkLayout
    from lmcache_client.integrations.paged import PagedCopier, probe_block_layout
    from lmcache_client.integrations.transfer import ChunkTransfer
    from lmcache_client.integrations.vllm.discovery import EngineLayout
    from lmcache_client.integrations.vllm.worker import WorkerSide

    layers, heads, dim, dtype_name = SHAPES[size_mib]
    dtype = getattr(torch, dtype_name)
    chunk = ChunkLayout(layers, heads, dim, CHUNK_TOKENS, dtype_name)
    blocks = 2 * BATCH * CHUNK_TOKENS // BLOCK + 8
    if layout == "cpu":
        write, source = cpu_writer()
        raw = torch.randn(layers, blocks, heads, BLOCK, 2 * dim).to(dtype)
        caches = [raw[i] for i in range(layers)]
    else:
        write, source = nhd_write, "FlashAttention-style stand-in"
        raw = torch.randn(layers, blocks, BLOCK, heads, 2 * dim).to(dtype)
        caches = [raw[i].permute(0, 2, 1, 3) for i in range(layers)]
    block = probe_block_layout(
        write,
        block_tokens=BLOCK,
        num_heads=heads,
        head_dim=dim,
        content=2 * dim,
        strides=caches[0].stride()[1:],
        dtype=dtype,
    )
    # Loads write through the engine's own cache write, as the connector does in vLLM.
    writers = [lambda k, v, s, cache=cache: write(k, v, cache, s) for cache in caches] if layout == "cpu" else None
    if not ENGINE_WRITE:
        writers = None
    worker = WorkerSide(ChunkTransfer(client, namespace, chunk.nbytes), chunk)
    copier = PagedCopier(caches, block, writers, threads=2)
    worker.attach(EngineLayout(layout, BLOCK, BLOCK, block, copier, [f"l{i}" for i in range(layers)]))
    worker.source = source  # type: ignore[attr-defined]
    return worker, chunk, blocks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="4,16,32", help="chunk sizes in MiB (4, 16, 32)")
    parser.add_argument("--layouts", default="cpu,nhd")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2, help="batches of 8 chunks per repetition")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--daemon-python",
        default=str(DAEMON_PYTHON if DAEMON_PYTHON.exists() else sys.executable),
        help="python of the daemon (default: the repo's .venv, so this can run in vLLM's venv)",
    )
    parser.add_argument(
        "--no-engine-write", action="store_true", help="cpu layout: retrieve with our strided copies, not vLLM's op"
    )
    args = parser.parse_args(argv)
    global ENGINE_WRITE
    ENGINE_WRITE = not args.no_engine_write
    raise_on_sigterm()

    import torch

    from lmcache_client import CacheClient, Namespace
    from lmcache_client.integrations.transfer import ChunkTransfer
    from lmcache_client.integrations.vllm.meta import LoadRequest, SaveRequest
    from lmcache_client.memtune import tune_malloc

    torch.set_num_threads(1)
    tune_malloc()
    rows: list[dict[str, Any]] = []
    with workspace("bench-paged-") as (procs, workdir):
        port = free_port()
        daemon = procs.start(
            "daemon",
            [args.daemon_python, "-m", "lmcache_server", "--set", f"listen=[tcp://127.0.0.1:{port}]"]
            + ["--set", "max_local_cpu_size=3GiB", "--set", "metrics_port=0", "--set", "log_level=WARNING"]
            + ["--set", "cache_policy=lru"]  # admit every put: the stores measure copies, not admission
            + ["--set", "shm_dir=/dev/shm"],
        )
        address = f"tcp://127.0.0.1:{port}"
        with CacheClient(address, timeout_s=60, fail_open=False) as client:
            deadline = time.monotonic() + 30
            while True:
                daemon.check_alive()
                try:
                    client.ping(timeout_s=0.5)
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            assert client.uses_shared_memory, "the benchmark needs the shared-memory path"
            prefault(client)
            meter = CpuMeter(lambda: [c.proc.pid for c in procs.children])
            for size in (int(s) for s in args.sizes.split(",")):
                for layout in args.layouts.split(","):
                    rows.append(
                        run_cell(client, size, layout, args, ChunkTransfer, SaveRequest, LoadRequest, Namespace)
                    )
                    print(_line(rows[-1]), flush=True)
            outside = meter.outside_load()
    print(f"\nother load during the run: {outside:.2f} cores (2-core machine)")
    print(f"{'size':>5} {'layout':>6} {'op':>9} {'paged':>8} {'contig':>8} {'paged/contig':>12}")
    for r in rows:
        for op in ("store", "retrieve"):
            p, c = r[f"paged_{op}"], r[f"contig_{op}"]
            print(f"{r['size_mib']:>4}M {r['layout']:>6} {op:>9} {p:>8,.0f} {c:>8,.0f} {p / c:>12.2f}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "outside_load_cores": outside}, indent=1))
    return 0


def prefault(client: Any) -> None:
    """Fill the pool once, then empty it: every page of it has been touched, as in a
    daemon that has been serving for a while (first-touch page faults are not the
    copies being measured)."""
    junk = bytearray(32 << 20)
    keys = [os.urandom(32) for _ in range(3 * 32)]
    for i in range(0, len(keys), 2):
        client.put(keys[i : i + 2], [junk, junk], namespace="bench-paged|prefault")
    client.clear(namespace="bench-paged|prefault")


def run_cell(
    client: Any,
    size: int,
    layout: str,
    args: Any,
    ChunkTransfer: Any,
    SaveRequest: Any,
    LoadRequest: Any,
    Namespace: Any,
) -> dict[str, Any]:  # noqa: N803, E501
    import torch

    namespace = f"bench-paged|{size}|{layout}|{os.getpid()}"
    worker, chunk, blocks = make_worker(size, layout, client, namespace)
    contiguous = ChunkTransfer(client, namespace + "|contig", chunk.nbytes)
    dtype = worker.engine.copier.dtype
    from lmcache_client.tensors import tensor_bytes

    tensors = [torch.randn(chunk.shape).to(dtype) for _ in range(BATCH)]
    payloads = [tensor_bytes(t) for t in tensors]  # zero-copy views: one memcpy each into the pool
    targets = [torch.empty(chunk.shape, dtype=dtype) for _ in range(BATCH)]
    block_ids = random.Random(size).sample(range(blocks), BATCH * CHUNK_TOKENS // BLOCK)
    counter = iter(range(10**9))

    def fresh_keys() -> list[bytes]:
        n = next(counter)
        return [os.urandom(24) + n.to_bytes(4, "little") + i.to_bytes(4, "little") for i in range(BATCH)]

    stored = fresh_keys()
    worker.save([SaveRequest("r", stored, 0, block_ids)])
    contig_stored = fresh_keys()
    contiguous.put(contig_stored, payloads)
    # The stores below fill the pool with fresh keys; the chunks the retrieves read stay.
    assert client.pin(stored, namespace=namespace) == [True] * BATCH
    assert client.pin(contig_stored, namespace=namespace + "|contig") == [True] * BATCH
    load = LoadRequest("r", stored, 0, 0, BATCH * CHUNK_TOKENS, block_ids)

    def paged_store() -> None:
        assert worker.save([SaveRequest("r", fresh_keys(), 0, block_ids)]) == BATCH

    def paged_retrieve() -> None:
        worker.load([load])
        assert not worker.take_failed_blocks()

    def contig_store() -> None:
        assert contiguous.put(fresh_keys(), payloads) == BATCH

    def contig_retrieve() -> None:
        assert contiguous.get_prefix_into(contig_stored, targets) == BATCH

    nbytes = BATCH * chunk.nbytes
    try:
        stats = measure_group(
            [(paged_store, None), (contig_store, None), (paged_retrieve, None), (contig_retrieve, None)],
            nbytes,
            args.calls,
            args.reps,
            warmup=1,
        )
    finally:
        client.unpin(stored, namespace=namespace)
        client.unpin(contig_stored, namespace=namespace + "|contig")
    return {
        "size_mib": size,
        "layout": layout,
        "layout_source": worker.source,
        "chunk_bytes": chunk.nbytes,
        "paged_store": stats[0].median,
        "contig_store": stats[1].median,
        "paged_retrieve": stats[2].median,
        "contig_retrieve": stats[3].median,
        "spread": {
            k: s.spread() for k, s in zip(("paged_store", "contig_store", "paged_retrieve", "contig_retrieve"), stats)
        },
    }


def _line(r: dict[str, Any]) -> str:
    return (
        f"{r['size_mib']} MiB {r['layout']} ({r['layout_source']}): store {r['paged_store']:,.0f} vs "
        f"{r['contig_store']:,.0f}, retrieve {r['paged_retrieve']:,.0f} vs {r['contig_retrieve']:,.0f} MiB/s"
    )


if __name__ == "__main__":
    sys.exit(main())
