"""One SGLang process against real daemons: ``python -m tests.integrations.sglang.sglang_harness.replica SPEC OUT``.

SPEC (JSON) names the role and the daemons: ``shm`` (a daemon sharing its pool
with local clients), ``frames`` (one that does not: payload frames), ``dead``
(the address of a daemon that was killed) and ``docs_extra_config`` (the
``--hicache-storage-backend-extra-config`` string of docs/integrations.md,
its address pointing at ``shm``).  Role ``a`` runs every check and stores
the pages of ``matrix``; role ``b`` (a fresh process) is handed A's results
and loads A's pages.  OUT gets one JSON object of observations: the test
process asserts on them, this script asserts nothing about our backend.
"""

from __future__ import annotations

import json
import random
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import engine

SGLANG = {
    "backend_name": "lmcache-server",
    "module_path": "lmcache_client.integrations.sglang.hicache",
    "class_name": "LMCacheServerHiCacheStorage",
}
CHECKED_METHODS = (
    "register_mem_pool_host",
    "register_mem_host_pool_v2",
    "on_host_pools_registered",
    "batch_exists",
    "batch_exists_v2",
    "batch_get_v1",
    "batch_set_v1",
    "batch_get_v2",
    "batch_set_v2",
    "clear",
    "get_stats",
)


def tokens(seed: int, pages: int, tail: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(pages * engine.PAGE + tail)]


def extra(address: str, tenant: str, **more: Any) -> dict[str, Any]:
    return {**SGLANG, "address": address, "timeout_s": 5.0, "tenant": tenant, **more}


def error_of(fn: Callable[[], Any]) -> str | None:
    """``"Type: message"`` of what ``fn`` raises (the whole chain), None if it returns."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - reported to the test process
        chain, cause = [], err
        while cause is not None:
            chain.append(f"{type(cause).__name__}: {cause}")
            cause = cause.__cause__
        return " <- ".join(chain)
    return None


def storage_config(**overrides: Any) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    fields: dict[str, Any] = dict(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=engine.MODEL,
    )
    fields.update(overrides)
    return HiCacheStorageConfig(**fields)


def uses_shm(backend: Any) -> bool:
    return any(c._pool is not None for c in backend._clients)


# -- role a --------------------------------------------------------------------------------
def classes() -> dict[str, Any]:
    import sglang
    from sglang.srt.mem_cache import hicache_storage

    from lmcache_client.integrations.sglang import hicache as sglang_hicache

    base, ours = hicache_storage.HiCacheStorage, sglang_hicache.LMCacheServerHiCacheStorage
    return {
        "sglang_version": sglang.__version__,
        "torch_version": torch.__version__,
        "base_is_sglangs": sglang_hicache.HiCacheStorage is base,
        "subclass": issubclass(ours, base),
        "base_abstract": sorted(base.__abstractmethods__),
        "ours_abstract": sorted(ours.__abstractmethods__),
        "base_public": sorted(n for n in dir(base) if not n.startswith("_")),
        "overridden": {m: getattr(ours, m) is not getattr(base, m) for m in CHECKED_METHODS},
    }


def factory(spec: dict[str, Any]) -> dict[str, Any]:
    """The backend built the way SGLang builds it from the documented command line."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    kv = engine.device_pool("mha", torch.float16)
    host = engine.host_pool("mha", kv, "page_first")

    def create(cli: str) -> Any:
        parsed, *_ = HybridCacheController.parse_storage_backend_extra_config(cli)
        backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra_config=parsed), host)
        backend.register_mem_pool_host(host)
        return backend

    docs = create(spec["docs_extra_config"])
    # SGLang's own keys (its parser takes them out) beside ours
    sglang_keys = {"prefetch_threshold": 128, "prefetch_timeout_base": 2, "hicache_storage_pass_prefix_keys": True}
    with_sglang_keys = json.loads(spec["docs_extra_config"]) | sglang_keys
    both = create(json.dumps(with_sglang_keys))
    typo = json.loads(spec["docs_extra_config"]) | {"adress": "tcp://127.0.0.1:1"}
    return {
        "type": f"{type(docs).__module__}.{type(docs).__qualname__}",
        "address": docs.address,
        "timeout_s": docs.timeout_s,
        "namespace": docs.namespace,
        "page_bytes": docs.page_bytes,
        "exists_empty": docs.batch_exists(["0" * 64]),
        "with_sglang_keys": type(both).__name__,
        "typo_error": error_of(lambda: create(json.dumps(typo))),
    }


def matrix(address: str, label: str, configs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Per host pool: a generic replica stores T, a zero-copy one loads it and stores U,
    which the generic one loads; every move through SGLang's controller threads."""
    out = []
    for n, (kind, layout) in enumerate(configs):
        tenant = f"{label}-{kind}-{layout}"
        generic = engine.Replica(extra(address, tenant), kind, layout)
        zero_copy = engine.Replica(extra(address, tenant, interface_v1=1), kind, layout)
        t, u = tokens(100 + n, 5, tail=7), tokens(200 + n, 4)
        try:
            stored_t = generic.store(t, seed=300 + n)
            loaded_t = zero_copy.load(t)
            stored_u = zero_copy.store(u, seed=400 + n)
            loaded_u = generic.load(u)
            out.append(
                {
                    "kind": kind,
                    "layout": layout,
                    "tenant": tenant,
                    "daemon": label,
                    "namespaces": [generic.backend.namespace, zero_copy.backend.namespace],
                    "page_funcs": [generic.ctl.page_get_func.__name__, zero_copy.ctl.page_get_func.__name__],
                    "set_funcs": [generic.ctl.page_set_func.__name__, zero_copy.ctl.page_set_func.__name__],
                    "host_pool": type(generic.host).__name__,
                    "shared_memory": [uses_shm(generic.backend), uses_shm(zero_copy.backend)],
                    "clients": [len(generic.backend._clients), len(zero_copy.backend._clients)],
                    "t": t,
                    "u": u,
                    "stored_t": stored_t,
                    "loaded_t": loaded_t,
                    "stored_u": stored_u,
                    "loaded_u": loaded_u,
                }
            )
        finally:
            generic.close()
            zero_copy.close()
    return out


def partial_and_wrong(address: str) -> dict[str, Any]:
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from lmcache_client import CacheClient
    from lmcache_client.integrations.sglang.hicache import page_key

    generic = engine.Replica(extra(address, "wrong"))
    zero_copy = engine.Replica(extra(address, "wrong", interface_v1=1))
    other_dtype = engine.Replica(extra(address, "wrong"), dtype=torch.bfloat16)
    try:
        t = tokens(1, 5)
        stored_head = generic.store(t[: 2 * engine.PAGE], seed=2)  # only the first two pages
        partial = zero_copy.load(t)
        w = tokens(3, 3)
        generic.store(w, seed=4)
        hashes = get_storage_hash_str(w, None, page_size=engine.PAGE)
        with CacheClient(address, generic.backend.namespace, fail_open=False) as raw:  # page 1 replaced
            raw.delete([page_key(hashes[1])])
            raw.put([page_key(hashes[1])], [b"\x01" * 100])
        backend = generic.backend
        dummy = generic.host.get_dummy_flat_data_page()
        return {
            "stored_head": stored_head["stored_tokens"],
            "partial": partial,
            "wrong_page_generic": generic.load(w),
            "wrong_page_zero_copy": zero_copy.load(w),
            "other_dtype": other_dtype.load(w),
            "other_dtype_namespace": other_dtype.backend.namespace,
            "set_short_page": backend.batch_set(hashes[:1], [torch.zeros(10, dtype=torch.float16)]),
            "set_count_mismatch": backend.batch_set(hashes[:2], [dummy]),
            "get_short_target": backend.batch_get(hashes[:1], [torch.zeros(3, dtype=torch.float16)]),
            "v1_wrong_slots": error_of(lambda: backend.batch_get_v1(hashes[:2], torch.arange(5))),
        }
    finally:
        for replica in (generic, zero_copy, other_dtype):
            replica.close()


def dead(address: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, more in (("generic", {}), ("zero_copy", {"interface_v1": 1})):
        replica = engine.Replica(extra(address, "dead", timeout_s=0.3, **more))
        try:
            t = tokens(5, 3)
            out[name] = {
                "stored": replica.store(t, seed=6)["stored_tokens"],
                "loaded": replica.load(t),
                "exists": replica.backend.batch_exists(["0" * 64]),
                "clear": replica.backend.clear(),
                "threads_alive": replica.threads_alive(),
            }
        finally:
            replica.close()
    return out


def stats(address: str) -> dict[str, Any]:
    from sglang.srt.observability.metrics_collector import StorageMetrics

    out: dict[str, Any] = {}
    for name, more in (("generic", {}), ("zero_copy", {"interface_v1": 1})):
        replica = engine.Replica(extra(address, f"stats-{name}", **more), metrics=True)
        plain = engine.Replica(extra(address, f"stats-{name}", **more))
        try:
            t = tokens(7, 3)
            replica.store(t, seed=8)
            replica.load(t)
            first, second = replica.backend.get_stats(), replica.backend.get_stats()
            out[name] = {
                "is_storage_metrics": isinstance(first, StorageMetrics),
                "backup_pgs": first.backup_pgs,
                "prefetch_pgs": first.prefetch_pgs,
                "bandwidth_positive": all(b > 0 for b in first.backup_bandwidth + first.prefetch_bandwidth),
                "bandwidth_counts": [len(first.backup_bandwidth), len(first.prefetch_bandwidth)],
                "second": [second.backup_pgs, second.prefetch_pgs],
                "without_metrics": plain.backend.get_stats(),
            }
        finally:
            replica.close()
            plain.close()
    return out


def refusals(address: str) -> dict[str, Any]:
    """What cannot work is refused at start, in SGLang's own construction path."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    kv = engine.device_pool("mha", torch.float16)

    def register(host: Any) -> None:
        cfg = storage_config(extra_config=extra(address, "refused"))
        StorageBackendFactory.create_backend("dynamic", cfg, host).register_mem_pool_host(host)

    asymmetric_kv = engine.device_pool("mha", torch.float16, v_head_dim=engine.HEAD_DIM // 2)
    dcp = storage_config(
        tp_size=2, is_mla_model=True, dcp_size=2, logical_page_size=2 * engine.PAGE, extra_config=extra(address, "x")
    )
    return {
        "sidecar_pool": error_of(lambda: engine.Replica(extra(address, "refused"), extra_pools=True)),
        "asymmetric_pool": type(engine.host_pool("mha", asymmetric_kv, "page_first")).__name__,
        "asymmetric": error_of(lambda: register(engine.host_pool("mha", asymmetric_kv, "page_first"))),
        "dcp": error_of(lambda: StorageBackendFactory.create_backend("dynamic", dcp, None)),
        "cuda_available": torch.cuda.is_available(),
        "pinned_host_pool": error_of(lambda: engine.host_pool("mha", kv, "layer_first", pin_memory=True)),
        "kv_split_mha": error_of(lambda: engine.host_pool("mha", kv, "page_first_kv_split")),
    }


def shards(address: str) -> dict[str, Any]:
    """Pipeline stages (and context-parallel ranks) never read each other's pages."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    kv = engine.device_pool("mha", torch.float16)
    host = engine.host_pool("mha", kv, "page_first")
    backends = {}
    for name, fields in (
        ("pp0", {"pp_size": 2, "pp_rank": 0}),
        ("pp1", {"pp_size": 2, "pp_rank": 1}),
        ("cp1", {"attn_cp_size": 2, "attn_cp_rank": 1}),
    ):
        cfg = storage_config(extra_config=extra(address, "shards"), **fields)
        backends[name] = StorageBackendFactory.create_backend("dynamic", cfg, host)
        backends[name].register_mem_pool_host(host)
    hashes = get_storage_hash_str(tokens(9, 2), None, page_size=engine.PAGE)
    pages = [host.get_data_page(i * engine.PAGE) for i in range(2)]
    try:
        return {
            "namespaces": {name: b.namespace for name, b in backends.items()},
            "pp0_set": backends["pp0"].batch_set(hashes, pages),
            "exists": {name: b.batch_exists(hashes) for name, b in backends.items()},
        }
    finally:
        for b in backends.values():
            b.close()


def role_a(spec: dict[str, Any]) -> dict[str, Any]:
    configs = [("mha", layout) for layout in engine.MHA_LAYOUTS] + [("mla", layout) for layout in engine.MLA_LAYOUTS]
    return {
        "classes": classes(),
        "factory": factory(spec),
        "matrix": matrix(spec["shm"], "shm", configs)
        + matrix(spec["frames"], "frames", [("mha", "page_first"), ("mla", "layer_first")]),
        "partial_and_wrong": partial_and_wrong(spec["shm"]),
        "dead": dead(spec["dead"]),
        "stats": stats(spec["shm"]),
        "refusals": refusals(spec["shm"]),
        "shards": shards(spec["shm"]),
    }


# -- role b --------------------------------------------------------------------------------
def role_b(spec: dict[str, Any]) -> dict[str, Any]:
    """A fresh process loads what A stored: T through the zero-copy path, U through the generic one."""
    out = []
    for entry in spec["a_matrix"]:
        address = spec[entry["daemon"]]
        loads = {}
        for name, more, toks in (("t", {"interface_v1": 1}, entry["t"]), ("u", {}, entry["u"])):
            replica = engine.Replica(extra(address, entry["tenant"], **more), entry["kind"], entry["layout"])
            try:
                loads[name] = replica.load(toks)
            finally:
                replica.close()
        out.append({"tenant": entry["tenant"], **loads})
    return {"matrix": out}


def main() -> int:
    spec_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    engine.single_rank()
    try:
        result = role_a(spec) if spec["role"] == "a" else role_b(spec)
    except Exception:
        out_path.write_text(json.dumps({"crashed": traceback.format_exc()}))
        return 1
    out_path.write_text(json.dumps(result, default=repr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
