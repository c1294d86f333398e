"""A reduced vLLM engine loop for the connector's stand-in tests (no vLLM needed).

Stand-ins of the objects vLLM 0.32 hands a KV connector (requests, scheduler
output, config, the attention layer whose ``impl.do_kv_cache_update`` the
connector probes) and :class:`Engine`, which drives a scheduler-side and a
worker-side connector the way vLLM's scheduler and model runner call them,
over CPU caches in the CPU backend's per-layer layout ``(blocks, kv_heads,
block_size, 2 * head_dim)`` with K transposed inside each block.  They test
our reading of vLLM; tests/integrations/vllm/test_vllm_real.py runs the connector inside vLLM.
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
import random
import time
from types import SimpleNamespace
from typing import Any

import torch

from lmcache_client import CacheClient
from lmcache_client.integrations.vllm.connector import LMCacheServerConnectorV1
from lmcache_client.integrations.vllm.meta import LMCacheServerConnectorMetadata

from .standins import cpu_write

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
    kv_transfer_params: dict[str, Any] | None = None
    all_token_ids: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = self.all_token_ids or list(self.prompt_token_ids)


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
    preempted_req_ids: set[str] | None = None


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
        self,
        address: str,
        tenant: str,
        *,
        dtype: Any = torch.float16,
        block_size: int = 4,
        chunk_size: int = 8,
        role: str = "kv_both",
        **extra: Any,
    ):
        self.config = vllm_config(address, dtype, block_size, chunk_size=chunk_size, tenant=tenant, **extra)
        self.config.kv_transfer_config.kv_role = role
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
        self.log: list[LMCacheServerConnectorMetadata] = []
        """The metadata of every step."""
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self.is_async = self.scheduler.settings.async_transfers

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
        self.log.append(meta)
        bound = pickle.loads(pickle.dumps(meta))
        self.worker.handle_preemptions(bound)  # vLLM calls it before the forward pass
        self.worker.bind_connector_metadata(bound)
        self.worker.start_load_kv(SimpleNamespace())
        for layer, (name, kv_layer) in enumerate(self.kv.items()):
            self.worker.wait_for_layer_load(name)
            for prompt, blocks, start, end in work:
                self.write(kv_layer, layer, prompt, blocks, start, end)
                if layer == 0:
                    self.computed_tokens.extend(range(start, end))
            self.worker.save_kv_layer(name, kv_layer, attn_metadata=None)
        self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(set(output.finished_req_ids))
        self.finished_sending |= sending or set()
        self.finished_recving |= recving or set()
        self.load_errors |= self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        self.scheduler.update_connector_output(SimpleNamespace(finished_recving=recving, finished_sending=sending))
        return meta

    def write(self, kv_layer: Any, layer: int, prompt: list[int], blocks: list[int], start: int, end: int) -> None:
        """What the model writes for tokens ``start .. end - 1`` of ``prompt`` into ``kv_layer``."""
        if end <= start:
            return
        rows = torch.stack([kv_value(prompt[p], p, layer) for p in range(start, end)], dim=1).to(kv_layer.dtype)
        slots = torch.tensor(
            [blocks[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)]
        )
        cpu_write(rows[0], rows[1], kv_layer, slots)

    def until(self, done: Any, what: str, finished: set[str] | None = None, timeout_s: float = 60.0) -> int:
        """Empty engine steps (vLLM keeps stepping while transfers run) until ``done()``;
        returns the steps taken."""
        deadline = time.monotonic() + timeout_s
        steps = 0
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not done after {steps} engine steps ({timeout_s} s)")
            self.step(SchedulerOutput(finished_req_ids=set(finished or ())), [])
            finished = None
            steps += 1
        return steps

    def prefill(
        self,
        req_id: str,
        prompt: list[int],
        *,
        local_hit: int = 0,
        step_tokens: int = 10_000,
        params: dict[str, Any] | None = None,
        decode: list[int] | None = None,
        fill_local: bool = False,
    ) -> dict[str, Any]:
        """Schedule a prompt: lookup, allocation, then chunked-prefill steps until computed,
        then decode steps (one, or one per token of ``decode``: the tokens it generates)."""
        request = Request(req_id, prompt, params)
        asked: list[Any] = []

        def answered() -> bool:  # vLLM asks again on every step while the answer is None
            asked.append(self.scheduler.get_num_new_matched_tokens(request, local_hit))
            return asked[-1][0] is not None

        log_start = len(self.log)
        self.until(answered, f"lookup of {req_id}")
        external, is_async = asked[-1]
        assert is_async is (self.is_async and external > 0)
        blocks = self.alloc(len(prompt))
        if fill_local:  # vLLM's own prefix cache holds the first local_hit tokens' KV
            for layer, kv_layer in enumerate(self.kv.values()):
                self.write(kv_layer, layer, prompt, blocks, 0, local_hit)
        self.scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: (blocks,)), external)
        if is_async:  # the request waits in WAITING_FOR_REMOTE_KVS until a worker reports its load
            self.until(lambda: req_id in self.finished_recving, f"load of {req_id}")
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
        # Decode steps: saved only with save_decode_cache (prompt chunks by default).
        tokens = list(prompt)
        for token in decode or [None]:
            if token is not None:  # the token sampled last step is computed in this one
                tokens.append(token)
                request.all_token_ids.append(token)
                if len(tokens) > len(blocks) * self.block_size:
                    more = self.alloc(self.block_size)
                    blocks.extend(more)
                    new_ids: tuple[list[int], ...] | None = (more,)
                else:
                    new_ids = None
            else:
                new_ids = None
            cached = CachedRequestData([req_id], set(), [new_ids], [computed])
            work = [(tokens, blocks, computed, computed + 1)] if token is not None else []
            metas.append(
                self.step(SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={req_id: 1}), work)
            )
            computed += 1 if token is not None else 0
        delay, params = self.scheduler.request_finished(request, blocks)
        assert delay is (self.is_async and bool(self.saved(metas)))
        sources = params["lmcache_prompt_sources"]  # every admitted request has them
        assert sum(sources.values()) == len(prompt), sources
        if delay:  # vLLM holds the blocks until every worker reports the saves done
            self.until(lambda: req_id in self.finished_sending, f"saves of {req_id}", finished={req_id})
        loads = [load for meta in self.log[log_start:] for load in meta.loads]
        return {
            "external": external,
            "blocks": blocks,
            "metas": metas,
            "loads": loads,
            "computed": list(self.computed_tokens),
            "sources": sources,
        }

    def ask(self, request: Any, local_hit: int = 0, timeout_s: float = 60.0) -> int | None:
        """``get_num_new_matched_tokens`` as vLLM's scheduler sees it over steps: while an
        asynchronous lookup is out the answer is None and vLLM asks again; returns the
        tokens to load, or None when the connector defers the request for another reason
        (a consumer waiting for a producer).  Checks the load is asynchronous iff it should be."""
        side = self.scheduler.scheduler
        assert side is not None
        deadline = time.monotonic() + timeout_s
        while True:
            n, is_async = self.scheduler.get_num_new_matched_tokens(request, local_hit)
            if n is not None:
                assert is_async is (self.is_async and n > 0)
                return int(n)
            if side.lookups is None or not side.lookups.asked(request.request_id):
                return None
            assert time.monotonic() < deadline, f"lookup of {request.request_id} never answered"
            time.sleep(0.001)

    @staticmethod
    def saved(metas: list[LMCacheServerConnectorMetadata]) -> int:
        return sum(len(meta.saves) for meta in metas)

    def stored(self, address: str) -> dict[bytes, bytes]:
        """Every chunk (and tail) this engine saved, read back from the daemon: key -> bytes."""
        worker = self.worker.worker
        assert worker is not None
        keys = [k for meta in self.log for save in meta.saves for k in [*save.keys, save.tail_key] if k is not None]
        with CacheClient(address, fail_open=False) as client:
            values = client.get(keys, namespace=worker.transfer.namespace)
        assert all(v is not None for v in values), "every saved chunk is in the daemon"
        return {k: bytes(v) for k, v in zip(keys, values)}  # type: ignore[arg-type]

    def rows(self, blocks: list[int], start: int, end: int, layer: int) -> Any:
        kv_layer = list(self.kv.values())[layer]
        return reference_rows(kv_layer, blocks, start, end, self.block_size)


def expected_rows(prompt: list[int], start: int, end: int, layer: int, dtype: Any) -> Any:
    return torch.stack([kv_value(prompt[p], p, layer) for p in range(start, end)], dim=1).to(dtype)
