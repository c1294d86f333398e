"""SGLang's own HiCache storage machinery, built on CPU as SGLang builds it for a
plain (kv-only) model: a ``MHATokenToKVPool`` or ``MLATokenToKVPool`` device pool
on ``"cpu"``, its host pool (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``, the
class and inputs SGLang's assembler picks), a ``HostPoolGroup`` with the
KV entry as anchor, and a ``HybridCacheController`` (what SGLang 0.5.23's
kv-only stack uses) that attaches the storage backend through
``StorageBackendFactory`` ("dynamic") and starts its real prefetch, prefetch-IO,
prefetch-sync and backup threads.

Two deviations from a served engine, both because there is no GPU:
``pin_memory=False`` for the host pool (SGLang's default ``True`` registers
the buffer with ``cudaHostRegister``) and a single-rank parallel context
stamped by hand with a one-process gloo group (a server publishes it from its
ServerArgs and builds its groups with NCCL).  The scheduler's part of a
prefetch (allocating host slots for the hit and queueing the transfer) is
done here with the controller's own ``allocate_storage_hit``.
"""

from __future__ import annotations

import hashlib
import itertools
import socket
import threading
from typing import Any

import torch
import torch.distributed as dist
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs, build_pool_entry
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host import HostPoolGroup
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel

PAGE, LAYERS, HEADS, HEAD_DIM = 16, 4, 2, 32  # MHA: 16 KiB fp16 pages
KV_LORA_RANK, ROPE_DIM = 32, 16  # MLA: kv_cache_dim 48, 6 KiB bf16 pages
DEVICE_TOKENS = 512
HOST_RATIO = 2.0
MODEL = "test/sglang-real"
WAIT_S = 60.0
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
_requests = itertools.count()


def single_rank() -> None:
    """The parallel state of a one-GPU server, and a one-process gloo group."""
    get_parallel().override_permanently(
        tp_size=1,
        tp_rank=0,
        pp_size=1,
        pp_rank=0,
        attn_tp_size=1,
        attn_tp_rank=0,
        attn_cp_size=1,
        attn_cp_rank=0,
        attn_dcp_size=1,
        attn_dcp_rank=0,
        dcp_size=1,
        dcp_rank=0,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def device_pool(kind: str, dtype: torch.dtype, v_head_dim: int | None = None) -> Any:
    """SGLang's device KV pool of a 4-layer model, on CPU."""
    if kind == "mha":
        return MHATokenToKVPool(
            DEVICE_TOKENS,
            PAGE,
            dtype,
            HEADS,
            HEAD_DIM,
            LAYERS,
            "cpu",
            False,
            v_head_dim=v_head_dim,
            start_layer=0,
            end_layer=LAYERS,
        )
    return MLATokenToKVPool(
        DEVICE_TOKENS, PAGE, dtype, KV_LORA_RANK, ROPE_DIM, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS
    )


def host_pool(kind: str, kv: Any, layout: str, pin_memory: bool = False) -> Any:
    """The host pool SGLang's assembler (build_kv_host_pool) builds for ``kv``."""
    if kind == "mha":
        cls, info, kwargs = _mha_host_inputs(kv)  # the assembler's own class choice and inputs
        return cls(info, HOST_RATIO, 0, PAGE, layout, pin_memory=pin_memory, **kwargs)
    return MLATokenToKVPoolHost(
        kv.get_device_pool_infos()[0].buffer_info,
        HOST_RATIO,
        0,
        PAGE,
        layout,
        pin_memory=pin_memory,
        override_kv_cache_dim=kv.kv_cache_dim,
        device_capacity_tokens=kv.size,
        start_layer=kv.start_layer,
        end_layer=kv.end_layer,
        target_layer_num=kv.layer_num,
    )


def page_digest(host: Any, slot: int) -> str:
    """SHA-256 of one host page's flat bytes (``get_data_page``, as stored)."""
    page = host.get_data_page(slot, flat=True).contiguous()
    return hashlib.sha256(page.view(torch.uint8).numpy().tobytes()).hexdigest()


class Replica:
    """One SGLang rank: device pool, host pool group and cache controller with our backend."""

    def __init__(
        self,
        extra_config: dict[str, Any],
        kind: str = "mha",
        layout: str = "page_first",
        dtype: torch.dtype | None = None,
        metrics: bool = False,
        extra_pools: bool = False,
    ):
        self.kind, self.layout = kind, layout
        dtype = dtype or (torch.float16 if kind == "mha" else torch.bfloat16)
        self.kv = device_pool(kind, dtype)
        self.host = host_pool(kind, self.kv, layout)
        layers = {i: i for i in range(LAYERS)}
        entries = [
            build_pool_entry(
                name=PoolName.KV,
                host_pool=self.host,
                device_pool=self.kv,
                layer_mapping=layers,
                transfer_layer_id_max=LAYERS,
                is_anchor=True,
            )
        ]
        if extra_pools:  # a sidecar pool, as speculative decoding's draft KV is
            draft_kv = device_pool(kind, dtype)
            entries.append(
                build_pool_entry(
                    name=PoolName.DRAFT,
                    host_pool=host_pool(kind, draft_kv, layout),
                    device_pool=draft_kv,
                    layer_mapping=layers,
                    transfer_layer_id_max=LAYERS,
                )
            )
        allocator = PagedTokenToKVPoolAllocator(DEVICE_TOKENS, PAGE, dtype, "cpu", self.kv, False)
        self.ctl = HybridCacheController(
            allocator,
            HostPoolGroup(entries),
            PAGE,
            dist.group.WORLD,
            load_cache_event=threading.Event(),
            io_backend="direct",
            storage_backend="dynamic",
            model_name=MODEL,
            storage_backend_extra_config=dict(extra_config),
            enable_storage_metrics=metrics,
        )
        self.backend = self.ctl.storage_backend

    def fill(self, slots: torch.Tensor, seed: int) -> None:
        """Random KV into the pages at ``slots`` (through SGLang's set_from_flat_data_page)."""
        g = torch.Generator().manual_seed(seed)
        dummy = self.host.get_dummy_flat_data_page()
        for start in slots[::PAGE].tolist():
            page = torch.randn(dummy.shape, generator=g).to(dummy.dtype)
            self.host.set_from_flat_data_page(start, page)

    def store(self, tokens: list[int], seed: int) -> dict[str, Any]:
        """Write the pages of ``tokens`` through the controller's backup thread."""
        n = len(tokens) // PAGE * PAGE
        slots = self.host.alloc(n)
        self.fill(slots, seed)
        hashes = get_storage_hash_str(tokens[:n], None, page_size=PAGE)
        self.ctl.write_storage(slots, tokens[:n], hashes)
        done = self.ctl.ack_backup_queue.get(timeout=WAIT_S)
        digests = [page_digest(self.host, s) for s in slots[::PAGE].tolist()]
        return {"stored_tokens": done.completed_tokens, "digests": digests, "slots": slots[::PAGE].tolist()}

    def load(self, tokens: list[int]) -> dict[str, Any]:
        """Prefetch ``tokens`` through the controller's threads, as the scheduler drives them."""
        handle = CacheRequestHandle(rid=f"req-{next(_requests)}", attempt_id=0)
        op = self.ctl.prefetch(handle, tokens)
        hit_op = self.ctl.prefetch_hit_queue.get(timeout=WAIT_S)
        assert hit_op is op, "another prefetch answered"
        hit = op.storage_hit_count
        if hit == 0:
            return {"hit_tokens": 0, "loaded_tokens": 0, "digests": [], "slots": []}
        slots, alloc_len = self.ctl.allocate_storage_hit(
            op, hit, allow_partial=True, min_tokens=0, evict_host=lambda _n: 0
        )
        op.storage_hit_count = alloc_len
        op.hash_value = op.hash_value[: alloc_len // PAGE]
        op.host_indices = slots
        self.ctl.prefetch_buffer.put(op)
        loaded = 0
        while True:
            ack = self.ctl.ack_prefetch_queue.get(timeout=WAIT_S)
            if ack.completed_tokens is not None:
                loaded = ack.completed_tokens
            if ack.completed_req:
                break
        starts = slots[::PAGE].tolist()[: loaded // PAGE]
        return {
            "hit_tokens": hit,
            "loaded_tokens": loaded,
            "digests": [page_digest(self.host, s) for s in starts],
            "slots": starts,
        }

    def threads_alive(self) -> bool:
        return all(
            t.is_alive()
            for t in (
                self.ctl.prefetch_thread,
                self.ctl.prefetch_io_aux_thread,
                self.ctl.prefetch_sync_thread,
                self.ctl.backup_thread,
            )
        )

    def close(self) -> None:
        self.ctl.detach_storage_backend()
