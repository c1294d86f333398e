"""vLLM V1 connector logic against stand-ins of vLLM's objects, with the real daemon.

These unit tests run without vLLM: its data objects are stand-ins carrying
the attributes vLLM 0.32 passes (requests, scheduler output, config, the
attention layer whose ``impl.do_kv_cache_update`` the connector probes); the
KV caches are CPU tensors in the CPU backend's per-layer layout ``(blocks,
kv_heads, block_size, 2 * head_dim)`` with K transposed inside each block.
A small engine loop drives the connector the way vLLM's scheduler and model
runner call it, including chunked prefill and a pickle round trip of the
metadata.  They test our reading of vLLM; tests/integrations/vllm/test_vllm_real.py runs the
connector inside real vLLM.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lmcache_client import CacheClient, chunk_keys  # noqa: E402
from lmcache_client.integrations.vllm.compat import HAVE_VLLM, KVConnectorBase_V1, KVConnectorMetadata  # noqa: E402
from lmcache_client.integrations.vllm.connector import (  # noqa: E402
    ConnectorSettings,
    LMCacheServerConnectorV1,
    layout_from_vllm_config,
)
from lmcache_client.integrations.vllm.discovery import UnsupportedLayout  # noqa: E402
from lmcache_client.integrations.vllm.meta import LMCacheServerConnectorMetadata  # noqa: E402

from ...conftest import Daemon  # noqa: E402
from .vllm_harness.engine import (  # noqa: E402
    HEAD_DIM,
    HEADS,
    LAYERS,
    CachedRequestData,
    Engine,
    NewRequestData,
    Request,
    Role,
    SchedulerOutput,
    expected_rows,
    vllm_config,
)


# -- scheduler + worker through the connector ----------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "block_size", "chunk_size"), [(torch.float16, 4, 8), (torch.bfloat16, 4, 6), (torch.float32, 16, 16)]
)
def test_replica_b_loads_what_replica_a_computed(
    engines: Callable[..., Engine], dtype: Any, block_size: int, chunk_size: int
) -> None:
    a, b = (
        engines(dtype=dtype, block_size=block_size, chunk_size=chunk_size),
        engines(dtype=dtype, block_size=block_size, chunk_size=chunk_size),
    )
    rng = random.Random(1)
    prefix = [rng.randrange(1000) for _ in range(5 * chunk_size + 3)]
    prompt_a, prompt_b = prefix + [1, 2, 3], prefix + [7, 8]

    first = a.prefill("a", prompt_a, step_tokens=chunk_size + 5)  # chunked prefill: saves arrive step by step
    assert first["external"] == 0
    saved = [s for meta in first["metas"] for s in meta.saves]
    assert sum(len(s.keys) for s in saved) == len(prompt_a) // chunk_size and len(saved) > 1

    second = b.prefill("b", prompt_b)
    hit = len(prefix) // chunk_size * chunk_size  # full chunks of the shared prefix
    assert second["external"] == hit
    assert second["computed"] == list(range(hit, len(prompt_b))), "B computes only the tokens after the hit"
    assert not b.load_errors
    for layer in range(LAYERS):
        assert torch.equal(
            b.rows(second["blocks"], 0, len(prompt_b), layer), expected_rows(prompt_b, 0, len(prompt_b), layer, dtype)
        )
    assert first["sources"] == {"vllm_cache": 0, "recomputed": len(prompt_a)}
    assert second["sources"] == {"vllm_cache": 0, "memory": hit, "recomputed": len(prompt_b) - hit}


def test_prompt_sources_count_each_request_once(engines: Callable[..., Engine]) -> None:
    """Each admitted request's prompt splits into vLLM's own hit, the daemon's tiers and the
    recomputed rest, summing to its length: in its outputs and once in the counters."""
    a, b = engines(), engines()
    prompt = list(range(200, 241))  # 5 chunks of 8 and a token
    a.prefill("a", prompt)
    run = b.prefill("b", prompt, local_hit=16, fill_local=True)
    assert run["sources"] == {"vllm_cache": 16, "memory": 24, "recomputed": 1}
    # Admitted twice (an asynchronous load resumes it this way, so does a preemption): counted once.
    request = Request("c", prompt)
    external = b.ask(request, 0)
    assert external == 40
    for n in (external, 0):
        b.scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([],)), n)
    data = b.scheduler.get_kv_connector_stats().data
    counted = {k.removeprefix("prompt_tokens_"): v for k, v in data.items() if k.startswith("prompt_tokens_") and v}
    assert counted == {"vllm_cache": 16, "memory": 24 + external, "recomputed": 1 + 1}
    _, params = b.scheduler.request_finished(request, [])
    assert params == {"lmcache_prompt_sources": {"vllm_cache": 0, "memory": 40, "recomputed": 1}}
    assert b.scheduler.request_finished(request, []) == (False, None)  # taken once


def test_never_reports_the_whole_prompt(engines: Callable[..., Engine]) -> None:
    """Everything but the last prompt token can be loaded (vLLM needs that one's logits)."""
    a, b = engines(), engines()
    prompt = list(range(100, 132))  # exactly 4 chunks of 8
    a.prefill("a", prompt)
    request = Request("b", prompt)
    assert b.ask(request, 0) == 31
    assert b.ask(request, 28) == 3
    assert b.ask(request, 31) == 0  # vLLM's own cache has it
    assert b.ask(Request("c", prompt[:8]), 0) == 7
    run = b.prefill("b2", prompt)
    assert run["computed"] == [31]
    for layer in range(LAYERS):
        assert torch.equal(b.rows(run["blocks"], 0, 32, layer), expected_rows(prompt, 0, 32, layer, torch.float16))
    assert b.ask(Request("d", []), 0) == 0


def test_load_beyond_vllms_own_prefix_hit_leaves_its_blocks_alone(engines: Callable[..., Engine]) -> None:
    a, b = engines(), engines()
    prompt = list(range(200, 241))
    a.prefill("a", prompt)
    run = b.prefill("b", prompt, local_hit=16)  # vLLM already holds 16 tokens (4 blocks)
    assert run["external"] == 40 - 16
    [load] = run["loads"]
    assert (load.start_token, load.end_token, load.first_chunk) == (16, 40, 2)
    local = run["blocks"][:4]
    for layer in range(LAYERS):
        kv_layer = list(b.kv.values())[layer]
        assert torch.all(kv_layer[local] == -1), "blocks of vLLM's own prefix hit were written"
        assert torch.equal(b.rows(run["blocks"], 16, 41, layer), expected_rows(prompt, 16, 41, layer, torch.float16))


@pytest.mark.parametrize("async_transfers", [True, False], ids=["async", "sync"])
def test_failed_load_reports_blocks_and_writes_no_garbage(
    engines: Callable[..., Engine], address: str, async_transfers: bool
) -> None:
    a, b = engines(), engines(async_transfers=async_transfers)
    prompt = list(range(300, 345))  # 5 full chunks + 5
    a.prefill("a", prompt)
    request = Request("b", prompt)
    external = b.ask(request, 0)
    assert external == 40
    namespace = b.worker.worker.transfer.namespace  # type: ignore[union-attr]
    with CacheClient(address, fail_open=False) as client:  # chunk 3 is evicted after the lookup
        assert client.delete(chunk_keys(prompt, 8)[3:4], namespace=namespace) == [True]
    blocks = b.alloc(len(prompt))
    b.scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: (blocks,)), external)
    if async_transfers:  # the load runs while the request waits; its errors come with its completion
        b.until(lambda: "b" in b.finished_recving, "load of b")
    else:
        out = SchedulerOutput([NewRequestData("b", prompt, (blocks,), external)], num_scheduled_tokens={"b": 5})
        b.step(out, [])
    assert b.load_errors == set(blocks[6:10]), "the blocks of tokens 24..39 must be recomputed"
    for layer in range(LAYERS):
        assert torch.equal(b.rows(blocks, 0, 24, layer), expected_rows(prompt, 0, 24, layer, torch.float16))
        assert torch.all(b.rows(blocks, 24, 40, layer) == -1), "tokens that failed to load were written"
    assert b.worker.get_block_ids_with_load_errors() == set()  # reported once


def test_daemon_down_is_a_miss_not_an_error(engines: Callable[..., Engine], daemon: Daemon) -> None:
    engine = engines(address=daemon.address)
    daemon.kill()
    for side in (engine.scheduler, engine.worker):
        for client in [side.client] + [lane.transfer.client for lane in side.lanes]:
            client.timeout_s = 0.3
    run = engine.prefill("x", list(range(40)))
    assert run["external"] == 0 and run["computed"] == list(range(40))


def test_metadata_of_a_decode_step_is_empty(engines: Callable[..., Engine]) -> None:
    run = engines().prefill("a", list(range(20)))
    decode = run["metas"][-1]
    assert decode.loads == [] and decode.saves == []


def test_resumed_request_replaces_its_blocks(engines: Callable[..., Engine]) -> None:
    engine = engines()
    prompt = list(range(500, 532))
    blocks = engine.alloc(32)
    sched = engine.scheduler
    assert engine.ask(Request("r", prompt), 0) == 0
    sched.update_state_after_alloc(Request("r", prompt), SimpleNamespace(), 0)
    meta = sched.build_connector_meta(
        SchedulerOutput([NewRequestData("r", prompt, (blocks,), 0)], num_scheduled_tokens={"r": 10})
    )
    assert [(s.first_chunk, len(s.keys)) for s in meta.saves] == [(0, 1)]
    fresh = engine.alloc(32)  # preempted, then resumed with new blocks
    cached = CachedRequestData(["r"], {"r"}, [(fresh,)], [10])
    meta = sched.build_connector_meta(SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={"r": 22}))
    [save] = meta.saves
    assert (save.first_chunk, len(save.keys), save.block_ids) == (1, 3, fresh)


# -- the connector class ---------------------------------------------------------------------------
def test_extra_config_is_validated() -> None:
    assert ConnectorSettings.from_extra_config({"timeout_s": "1.5", "chunk_size": 128}) == ConnectorSettings(
        timeout_s=1.5, chunk_size=128
    )
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys \\['adress'\\]"):
        ConnectorSettings.from_extra_config({"adress": "tcp://x:1"})
    with pytest.raises(ValueError, match="chunk_size"):
        ConnectorSettings.from_extra_config({"chunk_size": "big"})
    with pytest.raises(ValueError, match="positive"):
        ConnectorSettings.from_extra_config({"timeout_s": 0})


def test_layout_and_namespace_from_vllm_config(address: str) -> None:
    config = vllm_config(address, torch.bfloat16, 16)
    assert layout_from_vllm_config(config, 256).shape == (LAYERS, 2, 256, HEADS, HEAD_DIM)
    config.cache_config.cache_dtype = "fp8"
    assert layout_from_vllm_config(config, 256).dtype == "float8_e4m3fn"
    config = vllm_config(address, torch.bfloat16, 16, tenant="acme")
    connector = LMCacheServerConnectorV1(config, Role.WORKER)  # the older two-argument call works too
    try:
        assert connector.worker is not None and connector.scheduler is None
        assert connector.worker.transfer.namespace == (
            "test/paged-model|bfloat16|L2|KV2|D8|tp0of1|c256|layout=L2THD|tenant=acme"
        )
        assert connector.requires_kv_delivery is False
        assert connector.get_finished({"a"}) == (None, None)
    finally:
        connector.shutdown()


def _layers(*shape: int) -> dict[str, Any]:
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(*shape, dtype=torch.bfloat16) for i in range(LAYERS)}


@pytest.mark.parametrize(
    ("caches", "spec", "message"),
    [
        (_layers(2, 4, 16, HEADS, HEAD_DIM), None, "4-D"),  # the pre-0.32 five-dimensional layout
        (_layers(4, HEADS + 1, 16, 2 * HEAD_DIM), None, "expected 2 KV heads"),
        ({"model.layers.0.self_attn.attn": torch.zeros(4, HEADS, 16, 2 * HEAD_DIM)}, None, "1 KV cache layers"),
    ],
)
def test_layouts_it_cannot_read_are_refused_at_start(address: str, caches: Any, spec: Any, message: str) -> None:
    config = vllm_config(address, torch.bfloat16, 16)
    kv_cache_config = None
    if spec is not None:  # several groups: test_vllm_groups.py
        kind = type(spec, (), {"block_size": 16, "num_kv_heads": HEADS, "head_size": HEAD_DIM})
        kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=kind())])
    connector = LMCacheServerConnectorV1(config, Role.WORKER, kv_cache_config=kv_cache_config)
    try:
        with pytest.raises(UnsupportedLayout, match=message) as info:
            connector.register_kv_caches(caches)
        assert "STAND_IN_CPU" in str(info.value) and "per-layer shape" in str(info.value)
    finally:
        connector.shutdown()


def test_a_backend_without_a_cache_write_to_probe_is_refused(address: str) -> None:
    config = vllm_config(address, torch.bfloat16, 16)
    for name in config.compilation_config.static_forward_context:
        config.compilation_config.static_forward_context[name] = SimpleNamespace(
            impl=object(), attn_backend=SimpleNamespace(get_name=lambda: "MYSTERY")
        )
    connector = LMCacheServerConnectorV1(config, Role.WORKER)
    try:
        with pytest.raises(UnsupportedLayout, match="MYSTERY.*do_kv_cache_update"):
            connector.register_kv_caches(_layers(4, HEADS, 16, 2 * HEAD_DIM))
    finally:
        connector.shutdown()


def test_roles_and_settings(address: str) -> None:
    assert ConnectorSettings.from_extra_config({"malloc_tuning": "false"}).malloc_tuning is False
    with pytest.raises(ValueError, match="malloc_tuning"):
        ConnectorSettings.from_extra_config({"malloc_tuning": "maybe"})
    with pytest.raises(ValueError, match="backoff_s"):
        ConnectorSettings.from_extra_config({"backoff_s": 5, "max_backoff_s": 1})
    config = vllm_config(address, torch.float16, 4)
    config.kv_transfer_config.kv_role = "kv_sideways"
    with pytest.raises(ValueError, match="kv_role"):
        LMCacheServerConnectorV1(config, Role.SCHEDULER)


def test_connector_subclasses_the_base_in_use() -> None:
    """vLLM's KVConnectorBase_V1 where vLLM is installed, the local stand-in elsewhere."""
    assert issubclass(LMCacheServerConnectorV1, KVConnectorBase_V1)
    assert issubclass(LMCacheServerConnectorMetadata, KVConnectorMetadata)
    assert KVConnectorBase_V1.__module__.startswith("vllm.") == HAVE_VLLM


def test_tp_lookup_answers_the_smallest_hit_over_ranks(address: str) -> None:
    """Under tensor parallelism every rank stores its own shard; a chunk is reusable only
    where every rank holds it (two namespaces, in-process; test_vllm_tp.py runs TP 2 in vLLM)."""
    config = vllm_config(address, torch.float16, 4, chunk_size=8, tenant="tp-test")
    config.parallel_config.tensor_parallel_size = 2
    scheduler = LMCacheServerConnectorV1(config, Role.SCHEDULER)
    try:
        side = scheduler.scheduler
        assert side is not None and [t.namespace.split("|")[5] for t in side.transfers] == ["tp0of2", "tp1of2"]
        prompt = list(range(900, 941))  # 5 reusable chunks of 8
        keys = chunk_keys(prompt, 8)
        with CacheClient(address, fail_open=False) as c:
            c.put(keys[:5], [b"x" * 64] * 5, namespace=side.transfers[0].namespace)  # rank 0 holds 5
            c.put(keys[:3], [b"x" * 64] * 3, namespace=side.transfers[1].namespace)  # rank 1 only 3
        request = Request("r", prompt)
        answer = (None, False)
        while answer[0] is None:  # asynchronous lookups: vLLM asks again each step
            answer = scheduler.get_num_new_matched_tokens(request, 0)
        assert answer == (24, True)
    finally:
        scheduler.shutdown()


def test_lora_and_cache_salt_requests_get_keys_of_their_own(engines: Callable[..., Engine]) -> None:
    a, b = engines(), engines()
    prompt = list(range(700, 741))
    a.prefill("a", prompt)
    plain = Request("b", prompt)
    salted = SimpleNamespace(request_id="s", prompt_token_ids=prompt, cache_salt="tenant-7")
    lora = SimpleNamespace(request_id="l", prompt_token_ids=prompt, lora_request=SimpleNamespace(lora_name="sql"))
    image = SimpleNamespace(request_id="m", prompt_token_ids=prompt, mm_features=[object()])
    assert b.ask(plain, 0) == 40
    for request in (salted, lora, image):
        assert b.ask(request, 0) == 0, request


def test_sleep_mode_touches_no_cache_until_restored(engines: Callable[..., Engine]) -> None:
    """vLLM 0.33's sleep mode unmaps the KV caches between unregister_kv_caches and
    restore_kv_caches: a load scheduled meanwhile reports its blocks, writes nothing."""
    a, b = engines(), engines()
    prompt = list(range(800, 841))
    a.prefill("a", prompt)
    b.worker.unregister_kv_caches()
    run = b.prefill("b", prompt)
    assert run["external"] == 40 and b.load_errors == set(run["blocks"][:10])
    for layer in range(LAYERS):  # nothing was loaded into the (unmapped) caches
        assert torch.all(b.rows(run["blocks"], 0, 40, layer) == -1)
    b.worker.restore_kv_caches()
    b.load_errors.clear()
    again = b.prefill("c", prompt)
    assert not b.load_errors and again["computed"] == list(range(40, 41))


# -- prefill/decode handoff: kv_producer / kv_consumer ---------------------------------------------
def test_consumer_computes_only_the_last_token_of_a_producers_prompt(engines: Callable[..., Engine]) -> None:
    """The producer stores the prompt's partial last chunk too; the consumer loads all
    but the last token (vLLM needs its logits) and stores nothing."""
    producer, consumer = engines(role="kv_producer"), engines(role="kv_consumer")
    prompt = list(range(300, 345))  # 5 chunks of 8 and a tail of 5
    made = producer.prefill("p", prompt)
    [save] = made["metas"][0].saves
    assert (len(save.keys), save.tail_start, save.tail_tokens) == (5, 40, 5)
    assert producer.worker.worker is not None and producer.worker.worker.stats.stored_chunks == 6
    assert producer.ask(Request("p2", prompt), 0) == 0  # never loads
    run = consumer.prefill("c", prompt)
    assert run["external"] == 44 and run["computed"] == [44]
    assert not consumer.load_errors
    assert all(not meta.saves for meta in run["metas"])
    for layer in range(LAYERS):
        rows = consumer.rows(run["blocks"], 0, 45, layer)
        assert torch.equal(rows, expected_rows(prompt, 0, 45, layer, torch.float16))


def test_a_tail_is_never_read_as_a_chunk_of_another_prompt(engines: Callable[..., Engine]) -> None:
    producer, reader = engines(role="kv_producer"), engines()
    prompt = list(range(400, 445))  # 5 chunks of 8 and a tail of 5
    producer.prefill("p", prompt)
    longer = prompt + [7, 7, 7]  # its 6th chunk starts with the same 5 tokens: a full chunk, another key
    assert reader.ask(Request("l", longer), 0) == 40
    other_tail = prompt[:-1] + [999]  # same full chunks, another last token
    assert reader.ask(Request("o", other_tail), 0) == 40
    shorter = prompt[:-1]  # a tail of 4: another length, another key
    assert reader.ask(Request("s", shorter), 0) == 40
    assert reader.ask(Request("x", prompt), 0) == 44


def test_consumer_waits_for_the_producer_then_loads(engines: Callable[..., Engine]) -> None:
    producer, consumer = engines(role="kv_producer"), engines(role="kv_consumer", load_wait_s=60)
    prompt = list(range(500, 529))
    request = Request("c", prompt)
    assert consumer.scheduler.get_num_new_matched_tokens(request, 0) == (None, False)  # ask again later
    producer.prefill("p", prompt)
    answer = None
    while answer is None:  # the scheduler asks again each step (at most every POLL_S it reaches the daemon)
        answer, _ = consumer.scheduler.get_num_new_matched_tokens(request, 0)
    assert answer == 28
    stats = consumer.scheduler.get_kv_connector_stats()
    assert stats is not None and stats.data["load_waits"] == 1 and stats.data["load_wait_expired"] == 0


def test_consumer_computes_what_never_arrives(engines: Callable[..., Engine]) -> None:
    producer, consumer = engines(role="kv_producer"), engines(role="kv_consumer", load_wait_s=0.2)
    prompt = list(range(600, 637))
    producer.prefill("p", prompt[:16])  # the producer got as far as two chunks
    request = Request("c", prompt)
    answers = []
    while not answers or answers[-1] is None:
        answers.append(consumer.scheduler.get_num_new_matched_tokens(request, 0)[0])
    assert answers[0] is None and answers[-1] == 16
    stats = consumer.scheduler.get_kv_connector_stats()
    assert stats is not None and stats.data["load_wait_expired"] == 1
    no_wait = SimpleNamespace(request_id="n", prompt_token_ids=prompt, kv_transfer_params={"lmcache_load_wait_s": 0})
    assert consumer.ask(no_wait, 0) == 16  # a proxy's say


def test_pd_settings_are_validated() -> None:
    assert ConnectorSettings.from_extra_config({"load_wait_s": "2.5"}).load_wait_s == 2.5
    assert ConnectorSettings.from_extra_config({"store_tails": "true"}).store_tails is True
    with pytest.raises(ValueError, match="load_wait_s"):
        ConnectorSettings.from_extra_config({"load_wait_s": -1})


def test_consumer_does_not_wait_while_the_daemon_is_down(engines: Callable[..., Engine], daemon: Daemon) -> None:
    consumer = engines(address=daemon.address, role="kv_consumer", load_wait_s=600)
    daemon.kill()
    consumer.scheduler.client.timeout_s = 0.3
    run = consumer.prefill("c", list(range(40)))  # would hang for 600 s if it waited
    assert run["external"] == 0 and run["computed"] == list(range(40))


def test_the_old_module_path_still_loads_the_connector() -> None:
    """Engine configs written before the move name ``integrations.vllm_connector``."""
    import importlib

    import lmcache_client.integrations.vllm as room

    old = importlib.import_module("lmcache_client.integrations.vllm_connector")
    assert old.LMCacheServerConnectorV1 is LMCacheServerConnectorV1 is room.LMCacheServerConnectorV1
