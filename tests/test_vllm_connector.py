"""vLLM V1 connector logic against stand-ins of vLLM's objects, with the real daemon.

These unit tests run without vLLM: its data objects are stand-ins carrying
the attributes vLLM 0.32 passes (requests, scheduler output, config, the
attention layer whose ``impl.do_kv_cache_update`` the connector probes); the
KV caches are CPU tensors in the CPU backend's per-layer layout ``(blocks,
kv_heads, block_size, 2 * head_dim)`` with K transposed inside each block.
A small engine loop drives the connector the way vLLM's scheduler and model
runner call it, including chunked prefill and a pickle round trip of the
metadata.  They test our reading of vLLM; tests/test_vllm_real.py runs the
connector inside real vLLM.
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
import random
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lmcache_client import CacheClient, chunk_keys  # noqa: E402
from lmcache_client.integrations.vllm_compat import HAVE_VLLM, KVConnectorBase_V1, KVConnectorMetadata  # noqa: E402
from lmcache_client.integrations.vllm_connector import (  # noqa: E402
    ConnectorSettings,
    LMCacheServerConnectorV1,
    layout_from_vllm_config,
)
from lmcache_client.integrations.vllm_layout import UnsupportedLayout  # noqa: E402
from lmcache_client.integrations.vllm_meta import LMCacheServerConnectorMetadata  # noqa: E402

from .conftest import Daemon  # noqa: E402
from .vllm_harness.standins import cpu_write  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 2, 2, 8


def reference_rows(kv_layer: Any, block_ids: list[int], start: int, end: int, block_size: int) -> Any:
    """Token rows read one by one through the CPU layout: (2, tokens, heads, dim)."""
    n = kv_layer.shape[2]
    region = kv_layer.reshape(kv_layer.shape[0], HEADS, 2 * n * HEAD_DIM)
    rows = []
    for p in range(start, end):
        b, o = block_ids[p // block_size], p % block_size
        k = region[b, :, o : n * HEAD_DIM : n]
        v = region[b, :, n * HEAD_DIM + o * HEAD_DIM : n * HEAD_DIM + (o + 1) * HEAD_DIM]
        rows.append(torch.stack([k, v]))
    return torch.stack(rows, dim=1)


class StandInImpl:
    """The attention implementation's cache write, as the CPU backend does it."""

    kv_cache_dtype = "auto"

    def do_kv_cache_update(self, layer: Any, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None:
        cpu_write(key, value, kv_cache, slot_mapping)


class StandInAttention:
    impl = StandInImpl()
    attn_backend = SimpleNamespace(get_name=lambda: "STAND_IN_CPU")


# -- stand-ins of vLLM's objects ---------------------------------------------------------------
class Role(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


@dataclasses.dataclass
class Request:  # vllm.v1.request.Request, the attributes connectors read
    request_id: str
    prompt_token_ids: list[int]


@dataclasses.dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclasses.dataclass
class CachedRequestData:
    req_ids: list[str] = dataclasses.field(default_factory=list)
    resumed_req_ids: set[str] = dataclasses.field(default_factory=set)
    new_block_ids: list[tuple[list[int], ...] | None] = dataclasses.field(default_factory=list)
    num_computed_tokens: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = dataclasses.field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = dataclasses.field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    finished_req_ids: set[str] = dataclasses.field(default_factory=set)


def vllm_config(address: str, dtype: Any, block_size: int, **extra: Any) -> Any:
    model_config = SimpleNamespace(
        model="test/paged-model",
        dtype=dtype,
        get_num_layers=lambda parallel_config: LAYERS,
        get_num_kv_heads=lambda parallel_config: HEADS,
        get_head_size=lambda: HEAD_DIM,
    )
    return SimpleNamespace(
        model_config=model_config,
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        compilation_config=SimpleNamespace(
            static_forward_context={f"model.layers.{i}.self_attn.attn": StandInAttention() for i in range(LAYERS)}
        ),
        kv_transfer_config=SimpleNamespace(
            kv_connector="LMCacheServerConnectorV1",
            kv_role="kv_both",
            kv_connector_extra_config={"address": address, "timeout_s": 5.0, **extra},
        ),
    )


def kv_value(token: int, position: int, layer: int) -> Any:
    """What the stand-in model writes for a token: (2, heads, dim), depending on token,
    position and layer, so a row put in the wrong place shows."""
    base = torch.arange(2 * HEADS * HEAD_DIM, dtype=torch.float32).reshape(2, HEADS, HEAD_DIM)
    return (base + token * 0.5 + position * 0.25 + layer * 100.0) / 64.0


class Engine:
    """vLLM's scheduler + model runner, reduced to the calls a KV connector sees."""

    def __init__(
        self, address: str, tenant: str, *, dtype: Any = torch.float16, block_size: int = 4, chunk_size: int = 8
    ):
        self.config = vllm_config(address, dtype, block_size, chunk_size=chunk_size, tenant=tenant)
        self.block_size = block_size
        self.scheduler = LMCacheServerConnectorV1(self.config, Role.SCHEDULER, kv_cache_config=None)
        self.worker = LMCacheServerConnectorV1(self.config, Role.WORKER, kv_cache_config=None)
        num_blocks = 64
        self.kv = {
            f"model.layers.{i}.self_attn.attn": torch.full((num_blocks, HEADS, block_size, 2 * HEAD_DIM), -1.0).to(
                dtype
            )
            for i in range(LAYERS)
        }
        self.worker.register_kv_caches(self.kv)
        self.free = random.Random(0).sample(range(num_blocks), num_blocks)  # scattered block ids
        self.load_errors: set[int] = set()
        self.computed_tokens: list[int] = []

    def alloc(self, n_tokens: int) -> list[int]:
        n = -(-n_tokens // self.block_size)
        blocks, self.free = self.free[:n], self.free[n:]
        return blocks

    def step(
        self, output: SchedulerOutput, work: list[tuple[list[int], list[int], int, int]]
    ) -> LMCacheServerConnectorMetadata:
        """One engine step: metadata to the worker (pickled, as between processes), load,
        the forward pass writing KV of ``work`` (prompt, blocks, start, end) layer by layer, save."""
        meta = self.scheduler.build_connector_meta(output)
        self.worker.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))
        self.worker.start_load_kv(SimpleNamespace())
        for layer, (name, kv_layer) in enumerate(self.kv.items()):
            self.worker.wait_for_layer_load(name)
            for prompt, blocks, start, end in work:
                if end > start:
                    rows = torch.stack([kv_value(prompt[p], p, layer) for p in range(start, end)], dim=1).to(
                        kv_layer.dtype
                    )
                    slots = torch.tensor(
                        [
                            blocks[p // self.block_size] * self.block_size + p % self.block_size
                            for p in range(start, end)
                        ]
                    )
                    cpu_write(rows[0], rows[1], kv_layer, slots)
                if layer == 0:
                    self.computed_tokens.extend(range(start, end))
            self.worker.save_kv_layer(name, kv_layer, attn_metadata=None)
        self.worker.wait_for_save()
        self.load_errors |= self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        return meta

    def prefill(
        self, req_id: str, prompt: list[int], *, local_hit: int = 0, step_tokens: int = 10_000
    ) -> dict[str, Any]:
        """Schedule a prompt: lookup, allocation, then chunked-prefill steps until computed."""
        request = Request(req_id, prompt)
        external, is_async = self.scheduler.get_num_new_matched_tokens(request, local_hit)
        assert is_async is False
        blocks = self.alloc(len(prompt))
        self.scheduler.update_state_after_alloc(request, SimpleNamespace(), external)
        computed = local_hit + external
        self.computed_tokens = []
        metas = []
        first = True
        while computed < len(prompt):
            n = min(step_tokens, len(prompt) - computed)
            if first:
                out = SchedulerOutput(
                    [NewRequestData(req_id, prompt, (blocks,), computed)], num_scheduled_tokens={req_id: n}
                )
            else:
                cached = CachedRequestData([req_id], set(), [None], [computed])
                out = SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={req_id: n})
            metas.append(self.step(out, [(prompt, blocks, computed, computed + n)]))
            computed += n
            first = False
        # One decode step: never saved (prompt chunks only).
        cached = CachedRequestData([req_id], set(), [None], [computed])
        metas.append(self.step(SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={req_id: 1}), []))
        assert self.scheduler.request_finished(request, blocks) == (False, None)
        return {"external": external, "blocks": blocks, "metas": metas, "computed": list(self.computed_tokens)}

    def rows(self, blocks: list[int], start: int, end: int, layer: int) -> Any:
        kv_layer = list(self.kv.values())[layer]
        return reference_rows(kv_layer, blocks, start, end, self.block_size)


def expected_rows(prompt: list[int], start: int, end: int, layer: int, dtype: Any) -> Any:
    return torch.stack([kv_value(prompt[p], p, layer) for p in range(start, end)], dim=1).to(dtype)


@pytest.fixture(scope="module")
def shared_daemon(module_daemon_factory: Callable[..., Daemon]) -> Daemon:
    return module_daemon_factory()


@pytest.fixture
def address(shared_daemon: Daemon) -> str:
    return shared_daemon.address


@pytest.fixture
def engines(address: str, request: pytest.FixtureRequest) -> Iterator[Callable[..., Engine]]:
    """Engines on the module's daemon, in a tenant of the test's own."""
    made: list[Engine] = []
    tenant = "".join(c if c.isalnum() else "-" for c in request.node.name)

    def make(**kwargs: Any) -> Engine:
        kwargs.setdefault("address", address)
        made.append(Engine(tenant=tenant, **kwargs))
        return made[-1]

    yield make
    for engine in made:
        engine.scheduler.shutdown()
        engine.worker.shutdown()


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


def test_never_reports_the_whole_prompt(engines: Callable[..., Engine]) -> None:
    a, b = engines(), engines()
    prompt = list(range(100, 132))  # exactly 4 chunks of 8
    a.prefill("a", prompt)
    request = Request("b", prompt)
    assert b.scheduler.get_num_new_matched_tokens(request, 0) == (24, False)
    assert b.scheduler.get_num_new_matched_tokens(request, 24) == (0, False)  # vLLM's own cache has it
    assert b.scheduler.get_num_new_matched_tokens(Request("c", prompt[:8]), 0) == (0, False)
    assert b.scheduler.get_num_new_matched_tokens(Request("d", []), 0) == (0, False)


def test_load_beyond_vllms_own_prefix_hit_leaves_its_blocks_alone(engines: Callable[..., Engine]) -> None:
    a, b = engines(), engines()
    prompt = list(range(200, 241))
    a.prefill("a", prompt)
    run = b.prefill("b", prompt, local_hit=16)  # vLLM already holds 16 tokens (4 blocks)
    assert run["external"] == 40 - 16
    [load] = run["metas"][0].loads
    assert (load.start_token, load.end_token, load.first_chunk) == (16, 40, 2)
    local = run["blocks"][:4]
    for layer in range(LAYERS):
        kv_layer = list(b.kv.values())[layer]
        assert torch.all(kv_layer[local] == -1), "blocks of vLLM's own prefix hit were written"
        assert torch.equal(b.rows(run["blocks"], 16, 41, layer), expected_rows(prompt, 16, 41, layer, torch.float16))


def test_failed_load_reports_blocks_and_writes_no_garbage(engines: Callable[..., Engine], address: str) -> None:
    a, b = engines(), engines()
    prompt = list(range(300, 345))  # 5 full chunks + 5
    a.prefill("a", prompt)
    request = Request("b", prompt)
    external, _ = b.scheduler.get_num_new_matched_tokens(request, 0)
    assert external == 40
    namespace = b.worker.worker.transfer.namespace  # type: ignore[union-attr]
    with CacheClient(address, fail_open=False) as client:  # chunk 3 is evicted after the lookup
        assert client.delete(chunk_keys(prompt, 8)[3:4], namespace=namespace) == [True]
    blocks = b.alloc(len(prompt))
    b.scheduler.update_state_after_alloc(request, SimpleNamespace(), external)
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
        side.client.timeout_s = 0.3
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
    sched.get_num_new_matched_tokens(Request("r", prompt), 0)
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
        (_layers(4, HEADS, 16, 2 * HEAD_DIM), "MLAAttentionSpec", "only standard attention"),
        (_layers(4, HEADS, 16, 2 * HEAD_DIM), "two groups", "2 KV cache groups"),
    ],
)
def test_layouts_it_cannot_read_are_refused_at_start(address: str, caches: Any, spec: Any, message: str) -> None:
    config = vllm_config(address, torch.bfloat16, 16)
    kv_cache_config = None
    if spec == "two groups":
        group = SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=16, num_kv_heads=HEADS, head_size=HEAD_DIM))
        kv_cache_config = SimpleNamespace(kv_cache_groups=[group, group])
    elif spec is not None:
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
    where every rank holds it (two namespaces here: TP 2 does not run on this machine)."""
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
        assert scheduler.get_num_new_matched_tokens(Request("r", prompt), 0) == (24, False)
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
    assert b.scheduler.get_num_new_matched_tokens(plain, 0) == (40, False)
    for request in (salted, lora, image):
        assert b.scheduler.get_num_new_matched_tokens(request, 0) == (0, False), request


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
