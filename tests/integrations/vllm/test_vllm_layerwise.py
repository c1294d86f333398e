"""Layer-wise saves (``layerwise_save``, integrations/vllm/worker/layerwise.py): each layer's
tokens of the step's saves are copied out at ``save_kv_layer`` and stored from there,
through the stand-in engine (which writes the cache layer by layer and calls
``save_kv_layer`` after each, as vLLM's attention layers do) on a real daemon.
Real vLLM: test_vllm_layerwise_real.py."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lmcache_client.integrations.paged import token_slots  # noqa: E402
from lmcache_client.integrations.vllm.connector import LMCacheServerConnectorV1  # noqa: E402
from lmcache_client.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from lmcache_client.integrations.vllm.worker.layerwise import _Arena, saver_for  # noqa: E402

from .vllm_harness.engine import LAYERS, Engine, expected_rows  # noqa: E402

PROMPT = list(range(7000, 7000 + 8 * 9 + 5))  # 9 full chunks of 8 and a tail of 5


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_layerwise_saves_store_the_same_bytes_and_another_replica_loads_them(
    engines: Callable[..., Engine], address: str, is_async: bool
) -> None:
    a = engines(layerwise_save=True, async_transfers=is_async, store_tails=True)
    plain = engines(async_transfers=is_async, store_tails=True, tenant=f"plain-{is_async}")  # its own chunks
    worker = a.worker.worker
    assert worker is not None and worker.layerwise is not None
    a.prefill("a", PROMPT, step_tokens=20)  # saves spread over steps, chunks finished mid-step
    plain.prefill("p", PROMPT, step_tokens=20)
    assert worker.stats.layerwise_saves == Engine.saved(a.log) > 1
    assert worker.stats.layerwise_fallbacks == 0
    lw, ref = a.stored(address), plain.stored(address)
    assert len(lw) == 10 and lw == ref, "10 objects (9 chunks + the tail), byte for byte the gathered ones"
    # Another replica of the same tenant loads them: exactly the model's rows.
    b = engines(tenant=a.scheduler.settings.tenant, async_transfers=is_async, store_tails=True)
    run = b.prefill("b", PROMPT)
    assert run["external"] == len(PROMPT) - 1  # vLLM computes the last prompt token itself
    for layer in range(LAYERS):
        assert torch.equal(
            b.rows(run["blocks"], 0, len(PROMPT) - 1, layer),
            expected_rows(PROMPT, 0, len(PROMPT) - 1, layer, torch.float16),
        )
    assert worker.layerwise.arena.allocated > 0 and worker.layerwise.arena._free, "buffers handed back for reuse"


def test_a_layer_vllm_never_reports_falls_back_to_the_gather(engines: Callable[..., Engine], address: str) -> None:
    """vLLM may not call ``save_kv_layer`` for a layer (CUDA graphs captured whole, a backend
    without the hook): the save is gathered from the cache after the forward pass instead."""
    a = engines(layerwise_save=True, async_transfers=False)
    plain = engines(async_transfers=False, tenant="plain-fallback")
    skipped = "model.layers.1.self_attn.attn"
    original = a.worker.save_kv_layer

    def save_kv_layer(name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        if name != skipped:
            original(name, kv_layer, attn_metadata, **kwargs)

    a.worker.save_kv_layer = save_kv_layer  # type: ignore[method-assign]
    a.prefill("a", PROMPT, step_tokens=20)
    plain.prefill("p", PROMPT, step_tokens=20)
    worker = a.worker.worker
    assert worker is not None
    assert worker.stats.layerwise_saves == 0 and worker.stats.layerwise_fallbacks == Engine.saved(a.log) > 0
    assert a.stored(address) == plain.stored(address)


def test_gather_layer_copies_what_gather_copies_for_that_layer(engines: Callable[..., Engine]) -> None:
    a = engines()
    a.prefill("a", PROMPT)  # fills the cache with the model's rows
    copier = a.worker.worker.engine.copier  # type: ignore[union-attr]
    blocks = list(range(len(PROMPT) // a.block_size + 1))
    slots = token_slots(blocks, 3, 61, a.block_size)
    whole = torch.empty((LAYERS, 2, 58, *copier.layers[0].shape[1:2], copier.layout.head_dim), dtype=copier.dtype)
    copier.gather(slots, whole)
    plan = copier.layer_plan(slots)
    for layer in range(LAYERS):
        one = torch.empty((1, *whole.shape[1:]), dtype=copier.dtype)
        copier.gather_layer(plan, layer, one)
        assert torch.equal(one[0], whole[layer])
    with pytest.raises(IndexError):
        copier.gather_layer(plan, LAYERS, one)


def test_the_staging_arena_reuses_buffers_and_keeps_its_budget() -> None:
    arena = _Arena(1000, pinned=False)
    a = arena.take(600)
    assert a is not None and a.numel() == 600
    assert arena.take(600) is None, "over the budget: that save is gathered after the forward pass"
    arena.give(a)
    again = arena.take(400)
    assert again is a, "a free buffer of at most twice the size is reused"
    arena.give(again)
    big = arena.take(900)  # no free buffer fits: the unused one makes room
    assert big is not None and arena.allocated == 900


def test_layerwise_save_settings_and_refusals() -> None:
    assert ConnectorSettings.from_extra_config({}).layerwise_save is False
    on = ConnectorSettings.from_extra_config({"layerwise_save": "true", "layerwise_staging_mb": 64})
    assert on.layerwise_save and on.layerwise_staging_mb == 64
    with pytest.raises(ValueError, match="layerwise_staging_mb"):
        ConnectorSettings.from_extra_config({"layerwise_staging_mb": 0})
    assert LMCacheServerConnectorV1.requires_piecewise_for_cudagraph({"layerwise_save": True}) is True
    assert LMCacheServerConnectorV1.requires_piecewise_for_cudagraph({}) is False
    hybrid = SimpleNamespace(groups=[object()], copier=None, layer_names=[])
    with pytest.raises(ValueError, match="several KV cache groups"):
        saver_for(hybrid, False, (2, 2, 8, 2, 4), 1 << 20)
    mla = SimpleNamespace(groups=None, copier=object(), layer_names=[])
    with pytest.raises(ValueError, match="MLA"):
        saver_for(mla, False, (2, 1, 8, 1, 4), 1 << 20)
