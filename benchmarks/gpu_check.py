"""GPU check of the shared-memory path: DMA between the mapped daemon pool and a CUDA device.

Run on a host with a CUDA GPU and a CUDA build of torch:

    python benchmarks/gpu_check.py [--sizes 16,32] [--batch 8] [--reps 9] [--json out.json]

What it does, in one run:

1. starts ``python -m lmcache_server`` (ipc, shared memory on, ``pin_memory=auto``:
   the daemon page-locks its pool with ``cudaHostRegister``);
2. maps the pool with :class:`lmcache_client.CacheClient` (which registers its
   own mapping with ``cudaHostRegister`` on the first CUDA copy) and checks it
   really is the shared path;
3. per chunk size, GiB/s medians of ``--reps``:

   ``shm-get``   ``get_into(keys, cuda_tensors)``: request + host-to-device DMA
                 from the pool + release, through the daemon;
   ``shm-put``   ``put_tensors(keys, cuda_tensors)``: alloc + device-to-host DMA
                 into the pool + commit, through the daemon;
   ``pool-raw``  the bare copies between the registered pool mapping and the
                 device (no requests): the path's ceiling;
   ``pinned``    the baseline: copies between a ``torch.empty(pin_memory=True)``
                 tensor of the same size and the device;

   and checks every byte that came back (device -> pool -> device round trip).

4. the paged-copy section (``benchmarks/_batched.py``): a load and a save of
   ``--paged-chunks`` chunks of ``--paged-chunk-tokens`` tokens into a synthetic
   FlashAttention-shaped cache of ``--paged-layers`` layers, chunk by chunk
   (today's worker path) and batched (``integrations/batched.py``: one copier
   call for the batch on a side stream, completion by an event); prints both
   times and their ratio and checks the bytes.  ``--paged-device cpu`` runs
   only this section and the next, on the CPU (a smoke run of the same code).
5. the layer-wise section (``benchmarks/_layerwise.py``): a synthetic forward
   pass over that cache (``--layerwise-matmuls`` matmuls of hidden
   ``--layerwise-hidden`` per layer) with the step's save gathered after it or
   copied layer by layer during it (``layerwise_save``); prints how much of the
   save's time the overlap hides and checks the bytes.

Each row: ``{"path", "direction": "h2d"|"d2h", "size_bytes", "gib_per_s"}``
(paged rows: ``chunks``, ``chunk_tokens``, ``layers``, ``ms`` instead of ``size_bytes``);
the summary prints shm/pinned ratios (a page-locked pool should come within a
few percent of torch's pinned memory).  Without a GPU (or without CUDA in
torch) it says why, writes ``{"available": false, "reason": ...}`` when asked
for JSON, and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _batched import measure_paged  # noqa: E402
from _harness import MIB, raise_on_sigterm, wait_until, workspace  # noqa: E402
from _layerwise import measure_layerwise  # noqa: E402

NAMESPACE = "gpu-check"


def gpu_unavailable_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (CPU build, no driver, or no GPU)"
    return None


def timed(fn: Callable[[], None], nbytes: int, reps: int, sync: Callable[[], None]) -> float:
    fn()
    sync()  # warm-up
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        rates.append(nbytes / (time.perf_counter() - t0) / 1024**3)
    return statistics.median(rates)


def run(sizes_mib: Sequence[int], batch: int, reps: int) -> tuple[list[dict[str, Any]], list[str]]:
    import torch

    from lmcache_client import CacheClient

    rows: list[dict[str, Any]] = []
    notes: list[str] = [f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}"]
    pool_bytes = max(4 * batch * max(sizes_mib) * MIB, 1 << 30)
    with workspace("lmcache-gpu-check-") as (procs, workdir):
        endpoint = f"ipc://{workdir}/daemon.sock"
        daemon = procs.start(
            "daemon",
            [sys.executable, "-m", "lmcache_server", "--listen", endpoint, "--metrics-port", "0",
             "--max-local-cpu-size", f"{pool_bytes}B", "--set", "pin_memory=auto",
             "--set", f"max_message_size={max(512 * MIB, batch * max(sizes_mib) * MIB + MIB)}B"],
        )  # fmt: skip
        client = CacheClient(endpoint, NAMESPACE, timeout_s=60, fail_open=False)
        wait_until(lambda: _pings(client), 60, "daemon", daemon.check_alive)
        if not client.uses_shared_memory:
            raise SystemExit(f"the daemon's pool is not shared:\n{daemon.log_tail(20)}")
        notes.append("daemon: " + ("pool page-locked" if "page-locked with" in daemon.log_tail(50) else
                                   "pool NOT page-locked (see its log)"))  # fmt: skip
        counter = iter(range(1, 1 << 62))
        for size_mib in sizes_mib:
            rows += measure_size(client, size_mib * MIB, batch, reps, counter)
        client.close()
    return rows, notes


def measure_size(client: Any, size: int, batch: int, reps: int, counter: Any) -> list[dict[str, Any]]:
    """The six measurements of one chunk size (see the module docstring)."""
    import torch

    from lmcache_client import PutStatus, calls

    rows: list[dict[str, Any]] = []
    size_mib = size // MIB
    sync = torch.cuda.synchronize
    nbytes = size * batch
    elems = size // 2
    src = [torch.randn(elems, dtype=torch.float16, device="cuda") for _ in range(batch)]
    dst = [torch.empty(elems, dtype=torch.float16, device="cuda") for _ in range(batch)]
    pinned = [torch.empty(elems, dtype=torch.float16, pin_memory=True) for _ in range(batch)]

    def fresh_keys() -> list[bytes]:
        return [next(counter).to_bytes(32, "big") for _ in range(batch)]

    def put() -> None:
        statuses = client.put_tensors(fresh_keys(), src)
        if any(s != PutStatus.STORED for s in statuses):
            raise AssertionError(f"put not stored: {statuses}")

    keys = fresh_keys()
    assert client.put_tensors(keys, src) == [PutStatus.STORED] * batch

    def get() -> None:
        if not all(client.get_into(keys, dst)):
            raise AssertionError("get missed")

    get()
    sync()
    if not all(torch.equal(a, b) for a, b in zip(src, dst)):
        raise AssertionError("bytes changed on the device -> pool -> device round trip")
    pool = client._pool
    assert pool is not None
    # The raw ceiling: copies between the registered mapping (where the chunks are) and the device.
    located = client._run(calls.get_shm(NAMESPACE, keys, pool.segment))
    views = [pool._host_tensor(off, n).view(torch.float16) for off, n in located.loc]

    def raw_h2d() -> None:
        for d, v in zip(dst, views):
            d.copy_(v, non_blocking=True)

    def raw_d2h() -> None:
        for v, s in zip(views, src):
            v.copy_(s, non_blocking=True)

    def pinned_h2d() -> None:
        for d, p in zip(dst, pinned):
            d.copy_(p, non_blocking=True)

    def pinned_d2h() -> None:
        for p, s in zip(pinned, src):
            p.copy_(s, non_blocking=True)

    measured = {
        ("shm-get", "h2d"): timed(get, nbytes, reps, sync),
        ("pool-raw", "h2d"): timed(raw_h2d, nbytes, reps, sync),
        ("pinned", "h2d"): timed(pinned_h2d, nbytes, reps, sync),
        ("shm-put", "d2h"): timed(put, nbytes, reps, sync),
        ("pool-raw", "d2h"): timed(raw_d2h, nbytes, reps, sync),
        ("pinned", "d2h"): timed(pinned_d2h, nbytes, reps, sync),
    }
    client._run(calls.release([located.lease]))
    for (path, direction), rate in measured.items():
        rows.append({"path": path, "direction": direction, "size_bytes": size, "gib_per_s": round(rate, 2)})
        base = measured[("pinned", direction)]
        print(f"{size_mib:3d} MiB x{batch} {direction} {path:9s} {rate:7.2f} GiB/s  "
              f"({rate / base:.2f}x pinned)", flush=True)  # fmt: skip
    return rows


def _pings(client: Any) -> bool:
    try:
        client.ping(timeout_s=0.5)
        return True
    except Exception:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--sizes", default="16,32", help="chunk sizes in MiB (default 16,32)")
    p.add_argument("--batch", type=int, default=8, help="chunks per request (default 8)")
    p.add_argument("--reps", type=int, default=9, help="timed repetitions (default 9)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the rows (or the reason there are none) as JSON")
    p.add_argument("--paged-layers", type=int, default=32, help="paged section: layers (default 32)")
    p.add_argument("--paged-chunks", type=int, default=16, help="paged section: chunks per batch (default 16)")
    p.add_argument("--paged-chunk-tokens", type=int, default=256, help="paged section: tokens per chunk (default 256)")
    p.add_argument("--paged-device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: run only the paged section, on the CPU (default cuda: the whole check)")  # fmt: skip
    p.add_argument("--layerwise-hidden", type=int, default=4096, help="layer-wise section: hidden size (default 4096)")
    p.add_argument("--layerwise-matmuls", type=int, default=4, help="layer-wise section: matmuls per layer (default 4)")
    a = p.parse_args(argv)
    paged = (a.paged_layers, a.paged_chunks, a.paged_chunk_tokens, a.reps)
    forward = (a.layerwise_hidden, a.layerwise_matmuls)
    if a.paged_device == "cpu":
        rows = measure_paged("cpu", *paged)
        rows += measure_layerwise("cpu", *paged, *forward)
        if a.json is not None:
            a.json.write_text(json.dumps({"available": True, "device": "cpu", "rows": rows}, indent=1) + "\n")
        return 0
    reason = gpu_unavailable_reason()
    if reason is not None:
        print(f"gpu_check: nothing to measure here: {reason}.  Run it on a host with a CUDA GPU.")
        if a.json is not None:
            a.json.write_text(json.dumps({"available": False, "reason": reason}) + "\n")
        return 0
    raise_on_sigterm()
    sizes = [int(s) for s in a.sizes.split(",") if s.strip()]
    rows, notes = run(sizes, a.batch, a.reps)
    rows += measure_paged("cuda", *paged)
    rows += measure_layerwise("cuda", *paged, *forward)
    for note in notes:
        print(f"note: {note}")
    if a.json is not None:
        a.json.write_text(json.dumps({"available": True, "notes": notes, "rows": rows}, indent=1) + "\n")
        print(f"wrote {len(rows)} rows to {a.json}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
