"""A hybrid model's HiCache pools (KV, SWA, Mamba) through our v2 calls, in SGLang's venv.

``python -m tests.integrations.sglang.sglang_harness.hybrid SPEC OUT``; SPEC:
``{"address": ...}``.  Two replicas (A stores, B loads) each build, on CPU,
SGLang's host pool group of a hybrid model: the full-attention KV pool
(``MHATokenToKVPoolHost`` over a 4-layer ``MHATokenToKVPool``, the anchor), a
SWA pool (the same classes over a 2-layer pool) and a Mamba pool
(``MambaPoolHost`` over a ``MambaStateBufferInfo`` of 3 layers, one state slot
per page), and SGLang's ``HybridCacheController``, which attaches our
backend through ``StorageBackendFactory`` and registers every pool with it.
The v2 calls are then made as the controller makes them (``PoolTransfer``
with SGLang's page hashes, ``trailing_pages`` for SWA and Mamba), directly:
the radix tree that decides which pages to back up needs a served model.
OUT gets observations only; the test asserts on them.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host import HostPoolGroup
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.utils import get_storage_hash_str

from . import engine
from .replica import error_of, extra, storage_config, tokens

PAGE, PAGES = engine.PAGE, 4
MAMBA_LAYERS, MAMBA_SLOTS = 3, 16
SWA_LAYERS = 2


def digest(pool: Any, slot: int) -> str:
    return hashlib.sha256(pool.get_data_page(slot, flat=True).contiguous().view(torch.uint8).numpy()).hexdigest()


def fill(pool: Any, slots: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    dummy = pool.get_dummy_flat_data_page()
    for slot in slots:
        pool.set_from_flat_data_page(slot, torch.randint(0, 256, dummy.shape, dtype=torch.uint8, generator=g))


class HybridReplica:
    """SGLang's pools and controller of a hybrid (full + SWA + Mamba) model, our backend attached."""

    def __init__(self, extra_config: dict[str, Any]):
        self.kv_dev = engine.device_pool("mha", torch.float16)
        self.kv = engine.host_pool("mha", self.kv_dev, "page_first")
        self.swa_dev = MHATokenToKVPool(
            engine.DEVICE_TOKENS, PAGE, torch.float16, engine.HEADS, engine.HEAD_DIM, SWA_LAYERS, "cpu", False,
            start_layer=0, end_layer=SWA_LAYERS,
        )  # fmt: skip
        self.swa = engine.host_pool("mha", self.swa_dev, "page_first")
        info = MambaStateBufferInfo(
            temporal=torch.zeros(MAMBA_LAYERS, MAMBA_SLOTS, 2, 16, 16),
            conv=(torch.zeros(MAMBA_LAYERS, MAMBA_SLOTS, 3, 96, dtype=torch.bfloat16),),
        )
        self.mamba = MambaPoolHost(
            info, 2.0, 0, device_capacity=MAMBA_SLOTS, pin_memory=False, device="cpu", layout="page_first"
        )
        entries = [
            build_pool_entry(
                name=PoolName.KV,
                host_pool=self.kv,
                device_pool=self.kv_dev,
                layer_mapping={i: i for i in range(engine.LAYERS)},
                transfer_layer_id_max=engine.LAYERS,
                is_anchor=True,
            ),
            build_pool_entry(
                name=PoolName.SWA,
                host_pool=self.swa,
                device_pool=self.swa_dev,
                layer_mapping={i: i for i in range(SWA_LAYERS)},
                transfer_layer_id_max=engine.LAYERS,
            ),
            build_pool_entry(
                name=PoolName.MAMBA,
                host_pool=self.mamba,
                device_pool=None,
                layer_mapping={i: i for i in range(MAMBA_LAYERS)},
                transfer_layer_id_max=engine.LAYERS,
            ),
        ]
        allocator = PagedTokenToKVPoolAllocator(engine.DEVICE_TOKENS, PAGE, torch.float16, "cpu", self.kv_dev, False)
        self.ctl = HybridCacheController(
            allocator,
            HostPoolGroup(entries),
            PAGE,
            dist.group.WORLD,
            load_cache_event=threading.Event(),
            io_backend="direct",
            storage_backend="dynamic",
            model_name=engine.MODEL,
            storage_backend_extra_config=dict(extra_config),
        )
        self.backend = self.ctl.storage_backend
        self.pools = {"kv": self.kv, "swa": self.swa, "mamba": self.mamba}

    def slots(self, pool: str, pages: int) -> torch.Tensor:
        host = self.pools[pool]
        return host.alloc(pages * host.page_size)

    def transfers(self, hashes: list[str], slots: dict[str, torch.Tensor]) -> list[PoolTransfer]:
        """KV for every page; SWA for the last two pages; Mamba for the state after pages 2 and 4."""
        return [
            PoolTransfer(name=PoolName.KV, host_indices=slots["kv"], keys=hashes),
            PoolTransfer(
                name=PoolName.SWA,
                host_indices=slots["swa"],
                keys=hashes[-2:],
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            ),
            PoolTransfer(
                name=PoolName.MAMBA,
                host_indices=slots["mamba"],
                keys=[hashes[1], hashes[3]],
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            ),
        ]

    def close(self) -> None:
        self.ctl.detach_storage_backend()


def starts(host: Any, slots: torch.Tensor) -> list[int]:
    return [int(s) for s in slots[:: host.page_size].tolist()]


def run(spec: dict[str, Any]) -> dict[str, Any]:
    toks = tokens(21, PAGES)
    hashes = get_storage_hash_str(toks, None, page_size=PAGE)
    a = HybridReplica(extra(spec["address"], "hybrid"))
    b = HybridReplica(extra(spec["address"], "hybrid"))
    try:
        a_slots = {"kv": a.slots("kv", 4), "swa": a.slots("swa", 2), "mamba": a.slots("mamba", 2)}
        for i, (name, s) in enumerate(a_slots.items()):
            fill(a.pools[name], starts(a.pools[name], s), seed=i + 1)
        stored = a.backend.batch_set_v2(a.transfers(hashes, a_slots))
        # what the controller asks: SWA needs a prefix's last 2 pages, Mamba the state after its last
        queries = [
            PoolTransfer(name=PoolName.SWA, keys=hashes[-2:], hit_policy=PoolHitPolicy.TRAILING_PAGES),
            PoolTransfer(name=PoolName.MAMBA, keys=hashes[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES),
        ]

        def exists(keys: list[str], pools: Any = None) -> dict[str, Any]:
            r = b.backend.batch_exists_v2(keys, queries if pools is None else pools)
            pools_hit = dict(r.extra_pool_hit_pages)
            return {"kv": r.kv_hit_pages, "pools": pools_hit, "restorable": r.restorable_prefix_pages}

        other = get_storage_hash_str(toks[: 2 * PAGE] + tokens(22, 2), None, page_size=PAGE)
        b_slots = {"kv": b.slots("kv", 4), "swa": b.slots("swa", 2), "mamba": b.slots("mamba", 2)}
        loaded = b.backend.batch_get_v2(b.transfers(hashes, b_slots))
        same = {
            name: [
                digest(a.pools[name], x) == digest(b.pools[name], y)
                for x, y in zip(starts(a.pools[name], a_slots[name]), starts(b.pools[name], b_slots[name]), strict=True)
            ]
            for name in ("kv", "swa", "mamba")
        }
        side = b.backend.side_pools.pools
        client = b.backend._transfer().client  # the test's view of the daemon, in each namespace
        from lmcache_client.integrations.sglang.hicache import page_key

        keys = [page_key(h) for h in hashes]
        return {
            "stored": stored,
            "exists_full": exists(hashes),
            "exists_three_pages": exists(hashes[:3]),
            "exists_other_tail": exists(other),
            "exists_three_pages_mamba_only": exists(hashes[:3], queries[1:]),
            "loaded": loaded,
            "same": same,
            "namespaces": {"kv": b.backend.namespace, **{n: p.namespace.wire() for n, p in side.items()}},
            "page_bytes": {"kv": b.backend.page_bytes, **{n: p.page_bytes for n, p in side.items()}},
            "present": {
                "kv": client.exists(keys, namespace=b.backend.namespace),
                **{n: client.exists(keys, namespace=p.namespace) for n, p in side.items()},
            },
            "refused_pool": error_of(lambda: b.backend.register_mem_host_pool_v2(b.kv, PoolName.INDEXER)),
            "mla_tp": mla_tp(spec["address"], a),
            "wrong_size": wrong_size(b, client, side["mamba"].namespace),
            "dead": dead(spec["dead"], hashes),
        }
    finally:
        a.close()
        b.close()


def wrong_size(replica: HybridReplica, client: Any, namespace: Any) -> dict[str, Any]:
    """A state of another size under a Mamba key is not loaded; the slot keeps its bytes."""
    from lmcache_client.integrations.sglang.hicache import page_key

    hashes = get_storage_hash_str(tokens(23, 1), None, page_size=PAGE)
    put = client.put([page_key(hashes[0])], [b"x" * 100], namespace=namespace)
    slots = replica.slots("mamba", 1)
    before = digest(replica.mamba, int(slots[0]))
    got = replica.backend.batch_get_v2(
        [PoolTransfer(name=PoolName.MAMBA, host_indices=slots, keys=hashes, hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    )
    return {"put": [int(x) for x in put], "loaded": got, "untouched": digest(replica.mamba, int(slots[0])) == before}


def dead(address: str, hashes: list[str]) -> dict[str, Any]:
    """Against a daemon that is gone every v2 call is a miss, never an error in SGLang's threads."""
    r = HybridReplica(extra(address, "hybrid-dead", timeout_s=0.5))
    try:
        slots = {"kv": r.slots("kv", 4), "swa": r.slots("swa", 2), "mamba": r.slots("mamba", 2)}
        queries = [PoolTransfer(name=PoolName.MAMBA, keys=hashes[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        hit = r.backend.batch_exists_v2(hashes, queries)
        return {
            "set": r.backend.batch_set_v2(r.transfers(hashes, slots)),
            "exists": [hit.kv_hit_pages, dict(hit.extra_pool_hit_pages)],
            "get": r.backend.batch_get_v2(r.transfers(hashes, slots)[1:]),
        }
    finally:
        r.close()


def mla_tp(address: str, replica: HybridReplica) -> dict[str, Any]:
    """An MLA model at TP rank 1 of 2: its KV namespace is shared, its Mamba one is not."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    mla = engine.host_pool("mla", engine.device_pool("mla", torch.bfloat16), "page_first")
    cfg = storage_config(extra_config=extra(address, "hybrid-mla"), is_mla_model=True, tp_rank=1, tp_size=2)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, mla)
    try:
        backend.register_mem_pool_host(mla)
        backend.register_mem_host_pool_v2(replica.mamba, PoolName.MAMBA)
        backend.register_mem_host_pool_v2(replica.swa, PoolName.SWA)
        pools = backend.side_pools.pools
        return {"kv": backend.namespace, "mamba": pools["mamba"].namespace.wire(), "swa": pools["swa"].namespace.wire()}
    finally:
        backend.close()


def main() -> int:
    spec_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    engine.single_rank()
    try:
        result = run(spec)
    except Exception:
        out_path.write_text(json.dumps({"crashed": traceback.format_exc()}))
        return 1
    out_path.write_text(json.dumps(result, default=repr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
