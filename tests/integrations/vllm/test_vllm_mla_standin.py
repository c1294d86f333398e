"""MLA latents (issue 31 item 3) against stand-ins of vLLM 0.32's MLA objects, with the real daemon.

The stand-in cache write is vLLM's ``CPUMLAImpl.do_kv_cache_update`` as read
from the installed source (``flat = kv_cache.view(-1, 576)``; ``kv_c_normed``
into the first ``kv_lora_rank`` columns, ``k_pe`` into the rest), plus a
variant that puts ``k_pe`` first: the layout is probed, never assumed, and the
payload is ``kv_c_normed || k_pe`` either way.  The spec stand-ins carry the
attributes of ``MLAAttentionSpec``.  tests/integrations/vllm/test_vllm_mla.py
runs the connector inside real vLLM.
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lmcache_client import CacheClient, chunk_keys  # noqa: E402
from lmcache_client.integrations.chunklayout import CHUNK_LAYOUT, MLA_CHUNK_LAYOUT, ChunkLayout, MLAChunkLayout  # noqa: E402
from lmcache_client.integrations.paged import token_slots  # noqa: E402
from lmcache_client.integrations.vllm import connector as connector_module  # noqa: E402
from lmcache_client.integrations.vllm.connector import LMCacheServerConnectorV1, layout_from_vllm_config  # noqa: E402
from lmcache_client.integrations.vllm.discovery import UnsupportedLayout, discover  # noqa: E402
from lmcache_client.integrations.vllm.meta import LMCacheServerConnectorMetadata, SaveRequest  # noqa: E402

from .vllm_harness.engine import Role  # noqa: E402

LAYERS, RANK, ROPE, BLOCK = 3, 512, 64, 16
LATENT = RANK + ROPE
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


class CpuMLAImpl:
    """vLLM 0.32 ``CPUMLAImpl``'s cache write (``rope_first``: a made-up backend storing ``k_pe`` first)."""

    kv_lora_rank = RANK

    def __init__(self, rope_first: bool = False):
        self.rope_first = rope_first

    def do_kv_cache_update(
        self, kv_c_normed: Any, k_pe: Any, kv_cache: Any, slot_mapping: Any, kv_cache_dtype: str, k_scale: Any
    ) -> None:
        flat = kv_cache.view(-1, LATENT)
        slots = slot_mapping.flatten().long()
        k_pe = k_pe.squeeze(1)
        if self.rope_first:
            flat[slots, :ROPE], flat[slots, ROPE:] = k_pe.to(flat.dtype), kv_c_normed.to(flat.dtype)
        else:
            flat[slots, :RANK], flat[slots, RANK:] = kv_c_normed.to(flat.dtype), k_pe.to(flat.dtype)


class StandardImpl:
    """A standard attention write (key, value, ...): not an MLA cache write."""

    kv_lora_rank = RANK

    def do_kv_cache_update(self, layer: Any, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None:
        raise AssertionError("never called")


def mla_spec(kind: str = "MLAAttentionSpec", **fields: Any) -> Any:
    base = {
        "block_size": BLOCK,
        "num_kv_heads": 1,
        "head_size": LATENT,
        "cache_dtype_str": "auto",
        "state_content_bytes": None,
        "model_version": None,
        "alignment": None,
        "is_index_group_leader": False,
        "cache_role": SimpleNamespace(value="sparse"),
        "tokens_per_state": 1,
    }
    base.update(fields)
    return type(kind, (), base)()


def kv_cache_config(*specs: Any) -> Any:
    return SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, layer_names=NAMES) for s in specs or [mla_spec()]]
    )


def vllm_config(address: str, dtype: Any = torch.float32, tp_size: int = 1, impl: Any = None, **extra: Any) -> Any:
    impl = impl or CpuMLAImpl()
    attention = SimpleNamespace(impl=impl, attn_backend=SimpleNamespace(get_name=lambda: "STAND_IN_CPU_MLA"))
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model="test/mla-model",
            dtype=dtype,
            use_mla=True,
            get_num_layers=lambda parallel_config: LAYERS,
            get_num_kv_heads=lambda parallel_config: 1,
            get_head_size=lambda: LATENT,
        ),
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size),
        compilation_config=SimpleNamespace(static_forward_context={n: attention for n in NAMES}),
        kv_transfer_config=SimpleNamespace(
            kv_connector="LMCacheServerConnectorV1",
            kv_role="kv_both",
            kv_connector_extra_config={"address": address, "timeout_s": 5.0, "async_transfers": False} | extra,
        ),
    )


def caches(blocks: int = 8, dtype: Any = torch.float32, head_axis: bool = False) -> dict[str, Any]:
    shape = (blocks, 1, BLOCK, LATENT) if head_axis else (blocks, BLOCK, LATENT)
    return {n: torch.zeros(shape, dtype=dtype) for n in NAMES}


def latent(layer: int, tokens: int, dtype: Any = torch.float32) -> Any:
    """A recognisable latent per (layer, token): ``kv_c_normed || k_pe`` rows."""
    values = torch.arange(tokens * LATENT, dtype=torch.float32).view(tokens, LATENT) / 1024 + layer
    return values.to(dtype)


def write_latents(impl: CpuMLAImpl, kv: dict[str, Any], slots: Any, tokens: int, dtype: Any) -> None:
    for layer, name in enumerate(NAMES):
        rows = latent(layer, tokens, dtype)
        impl.do_kv_cache_update(rows[:, :RANK], rows[:, RANK:].unsqueeze(1), kv[name], slots, "auto", None)


@pytest.mark.parametrize(
    ("dtype", "rope_first", "head_axis"),
    [(torch.float32, False, False), (torch.bfloat16, False, True), (torch.float16, True, False)],
)
def test_the_probe_reads_where_the_latent_is_and_copies_are_exact(
    address: str, dtype: Any, rope_first: bool, head_axis: bool
) -> None:
    impl = CpuMLAImpl(rope_first)
    config = vllm_config(address, dtype, impl=impl)
    chunk = layout_from_vllm_config(config, 32)
    assert isinstance(chunk, MLAChunkLayout) and chunk.shape == (LAYERS, 1, 32, 1, LATENT)
    kv = caches(dtype=dtype, head_axis=head_axis)
    engine = discover(kv, config, kv_cache_config(), chunk)
    assert "MLA latent" in engine.describe()
    block_ids, n = [5, 2, 7], 40  # tokens 0..39 over scheduler blocks 5, 2, 7
    slots = token_slots(block_ids, 0, n, BLOCK)
    write_latents(impl, kv, slots.blocks * BLOCK + slots.offsets, n, dtype)
    out = torch.empty((LAYERS, 1, n, 1, LATENT), dtype=dtype)
    engine.copier.gather(slots, out)
    for layer in range(LAYERS):
        assert torch.equal(out[layer, 0, :, 0], latent(layer, n, dtype)), f"layer {layer}"
    fresh = caches(dtype=dtype, head_axis=head_axis)
    again = discover(fresh, config, kv_cache_config(), chunk)
    again.copier.scatter(slots, out)  # through the backend's own write
    for name in NAMES:
        assert torch.equal(fresh[name], kv[name])


def test_a_non_storing_rank_loads_rank_zeros_chunks(address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """TP 2: one namespace (``tp0of1``) for both ranks; rank 1 stores nothing, loads rank 0's."""
    tenant = f"mla-tp-{random.randrange(1 << 30)}"
    ranks = {}
    for rank in (0, 1):
        monkeypatch.setattr(connector_module, "tp_rank", lambda rank=rank: rank)
        ranks[rank] = LMCacheServerConnectorV1(
            vllm_config(address, tp_size=2, tenant=tenant, chunk_size=32), Role.WORKER
        )
    scheduler = LMCacheServerConnectorV1(vllm_config(address, tp_size=2, tenant=tenant, chunk_size=32), Role.SCHEDULER)
    try:
        wire = f"test/mla-model|float32|L{LAYERS}|KV1|D{LATENT}|tp0of1|c32|layout=L1TC|tenant={tenant}"
        assert [c.worker.transfer.namespace for c in ranks.values()] == [wire, wire]  # type: ignore[union-attr]
        assert scheduler.scheduler is not None
        assert [t.namespace for t in scheduler.scheduler.transfers] == [wire], "one lookup, not one per rank"
        assert [c.worker.stores for c in ranks.values()] == [True, False]  # type: ignore[union-attr]
        kv = {rank: caches() for rank in ranks}
        impl = CpuMLAImpl()
        prompt = [random.Random(3).randrange(1000) for _ in range(64)]
        keys = chunk_keys(prompt, 32)
        slots = token_slots([1, 3, 4, 6], 0, 64, BLOCK)
        for rank, conn in ranks.items():
            conn.register_kv_caches(kv[rank])
            write_latents(impl, kv[rank], slots.blocks * BLOCK + slots.offsets, 64, torch.float32)
        save = SaveRequest("r", keys, 0, [1, 3, 4, 6])
        with CacheClient(address, fail_open=False) as c:
            assert ranks[1]._worker().save([save]) == 0, "rank 1 stores nothing"
            assert c.lookup(keys, namespace=wire).hit_chunks == 0
            assert ranks[0]._worker().save([save]) == 2
            assert c.lookup(keys, namespace=wire).hit_chunks == 2
            stored = c.get(keys, namespace=wire)
        chunk = MLAChunkLayout.of(LAYERS, LATENT, 32, "float32")
        for i, blob in enumerate(stored):
            payload = torch.frombuffer(bytearray(blob), dtype=torch.float32).view(chunk.shape)
            for layer in range(LAYERS):
                assert torch.equal(payload[layer, 0, :, 0], latent(layer, 64)[32 * i : 32 * (i + 1)])
    finally:
        for conn in [*ranks.values(), scheduler]:
            conn.shutdown()


def test_mla_chunks_have_a_layout_and_namespace_of_their_own() -> None:
    mla = MLAChunkLayout.of(61, 576, 256, "bfloat16")
    assert mla.shape == (61, 1, 256, 1, 576) and mla.nbytes == 61 * 256 * 576 * 2
    assert MLA_CHUNK_LAYOUT != CHUNK_LAYOUT
    wire = mla.namespace("deepseek-ai/DeepSeek-V3", tp_rank=3, tp_size=8).wire()
    assert wire == mla.namespace("deepseek-ai/DeepSeek-V3").wire() and "tp0of1" in wire and "layout=L1TC" in wire
    # A standard layout of the same numbers (1 head of 576) is another namespace: never read as the other.
    assert ChunkLayout(61, 1, 576, 256, "bfloat16").namespace("deepseek-ai/DeepSeek-V3").wire() != wire
    with pytest.raises(ValueError, match="one head"):
        MLAChunkLayout(61, 2, 576, 256, "bfloat16")


@pytest.mark.parametrize(
    ("specs", "impl", "message"),
    [
        ([mla_spec(cache_dtype_str="fp8_ds_mla", state_content_bytes=656)], None, "packed MLA cache fp8_ds_mla"),
        ([mla_spec(cache_dtype_str="fp8")], None, "quantized MLA cache"),
        ([mla_spec(is_index_group_leader=True)], None, "indexer"),
        ([mla_spec(cache_role=SimpleNamespace(value="indexer"))], None, "indexer"),
        ([mla_spec(model_version="deepseek_v4")], None, "sparse-attention MLA"),
        ([mla_spec(), mla_spec()], None, "2 KV cache groups"),
        ([mla_spec("SlidingWindowMLASpec")], None, "SlidingWindowMLASpec"),
        ([mla_spec()], StandardImpl(), "MLA cache write takes"),
    ],
)
def test_mla_caches_it_cannot_read_are_refused_at_start(address: str, specs: Any, impl: Any, message: str) -> None:
    """Refused with one message naming the cache, at construction or at ``register_kv_caches``."""
    config = vllm_config(address, impl=impl)
    with pytest.raises(ValueError, match=message):  # UnsupportedLayout is a ValueError
        connector = LMCacheServerConnectorV1(config, Role.WORKER, kv_cache_config=kv_cache_config(*specs))
        try:
            connector.register_kv_caches(caches())
        finally:
            connector.shutdown()


def test_an_mla_cache_under_a_model_config_without_mla_is_refused(address: str) -> None:
    config = vllm_config(address)
    config.model_config.use_mla = False
    config.model_config.get_head_size = lambda: 64
    connector = LMCacheServerConnectorV1(config, Role.WORKER, kv_cache_config=kv_cache_config())
    try:
        with pytest.raises(UnsupportedLayout, match="MLA latent cache"):
            connector.register_kv_caches(caches())
    finally:
        connector.shutdown()


def test_async_saves_every_rank_reports_finished_and_only_rank_zero_stores(
    address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM frees a request's blocks once EVERY rank lists it in ``finished_sending``:
    the rank that stores nothing must report it too (asynchronous transfers)."""
    tenant = f"mla-async-{random.randrange(1 << 30)}"
    prompt = [random.Random(4).randrange(1000) for _ in range(64)]
    keys = chunk_keys(prompt, 32)
    meta = LMCacheServerConnectorMetadata(saves=[SaveRequest("r", keys, 0, [1, 3, 4, 6])], delayed=["r"])
    finished = {}
    for rank in (1, 0):
        monkeypatch.setattr(connector_module, "tp_rank", lambda rank=rank: rank)
        config = vllm_config(address, tp_size=2, tenant=tenant, chunk_size=32, async_transfers=True)
        conn = LMCacheServerConnectorV1(config, Role.WORKER)
        try:
            assert conn.transfers is not None, "asynchronous mode"
            conn.register_kv_caches(caches())
            conn.bind_connector_metadata(meta)
            conn.wait_for_save()
            sending: set[str] = set()
            for _ in range(500):  # the save lane answers within a few steps
                done, _ = conn.get_finished(set())
                sending |= done or set()
                if sending:
                    break
                time.sleep(0.01)
            finished[rank] = sending
            conn.clear_connector_metadata()
            wire = conn.worker.transfer.namespace  # type: ignore[union-attr]
            with CacheClient(address, fail_open=False) as c:
                hits = c.lookup(keys, namespace=wire).hit_chunks
            assert hits == (0 if rank == 1 else 2), f"rank {rank}"
        finally:
            conn.shutdown()
    assert finished == {0: {"r"}, 1: {"r"}}
