"""Per-request control (``kv_transfer_params``) and ``save_decode_cache``, through the
stand-in engine (vllm_harness/engine.py) on a real daemon, asynchronous transfers on."""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lmcache_client import CacheClient, PutStatus, chunk_keys  # noqa: E402
from lmcache_client.integrations.vllm.meta import LMCacheServerConnectorMetadata  # noqa: E402
from lmcache_client.integrations.vllm.params import RequestParams, request_params  # noqa: E402
from lmcache_client.integrations.vllm.scheduler import CostGate  # noqa: E402
from lmcache_client.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from lmcache_client.integrations.vllm.worker import WorkerSide  # noqa: E402
from lmcache_client.protocol import KEY_BYTES  # noqa: E402

from ...conftest import disk_stats, wait_for  # noqa: E402
from .vllm_harness.engine import (  # noqa: E402
    LAYERS,
    Engine,
    NewRequestData,
    Request,
    SchedulerOutput,
    expected_rows,
)

PROMPT = list(range(1000, 1041))  # 5 full chunks of 8 + 1


def saved_keys(run: dict[str, object]) -> int:
    return sum(len(save.keys) for meta in run["metas"] for save in meta.saves)  # type: ignore[attr-defined]


def test_skip_load_computes_what_the_daemon_holds(engines: Callable[..., Engine]) -> None:
    a, b = engines(), engines()
    a.prefill("a", PROMPT)
    assert b.ask(Request("b", PROMPT)) == 40
    assert b.ask(Request("c", PROMPT, {"lmcache_skip_load": True})) == 0


def test_skip_save_stores_nothing(engines: Callable[..., Engine]) -> None:
    a, b = engines(), engines()
    run = a.prefill("a", PROMPT, params={"lmcache_skip_save": True})
    assert saved_keys(run) == 0 and b.ask(Request("b", PROMPT)) == 0


def test_max_store_tokens_stores_a_prefix_capped_by_the_operator(engines: Callable[..., Engine]) -> None:
    a, b = engines(), engines()
    run = a.prefill("a", PROMPT, params={"lmcache_max_store_tokens": 20})
    assert saved_keys(run) == 2 and b.ask(Request("b", PROMPT)) == 16
    capped = engines(max_store_tokens=8, tenant="capped")
    run = capped.prefill("c", PROMPT, params={"lmcache_max_store_tokens": 30})
    assert saved_keys(run) == 1


def test_tags_keep_chunks_apart(engines: Callable[..., Engine]) -> None:
    a, b = engines(), engines()
    a.prefill("a", PROMPT, params={"lmcache_tags": ["team-x", "v2"]})
    assert b.ask(Request("untagged", PROMPT)) == 0
    assert b.ask(Request("other", PROMPT, {"lmcache_tags": "team-y"})) == 0
    assert b.ask(Request("same", PROMPT, {"lmcache_tags": ["v2", "team-x", "v2"]})) == 40  # a set: order, repeats


def test_bad_values_are_ignored_with_a_warning(
    engines: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = engines(), engines()
    a.prefill("a", PROMPT)
    bad = {"lmcache_skip_load": "yes", "lmcache_max_store_tokens": -1, "lmcache_tags": [""], "lmcache_nope": 1}
    with caplog.at_level(logging.WARNING, logger="lmcache_client.integrations.vllm.params"):
        assert b.ask(Request("b", PROMPT, bad)) == 40
    text = caplog.text
    for name in ("lmcache_skip_load", "lmcache_max_store_tokens", "lmcache_tags", "lmcache_nope"):
        assert name in text
    assert request_params(SimpleNamespace(kv_transfer_params={"other_connector": 1})) == RequestParams()


def test_load_deadline_is_capped_by_the_operator() -> None:
    def ask(value: object, cap: float) -> float | None:
        request = SimpleNamespace(request_id="r", kv_transfer_params={"lmcache_load_deadline_ms": value})
        return request_params(request, load_deadline_ms=cap).load_deadline_s

    assert ask(250, 0) == 0.25 and ask(250, 100) == 0.1 and ask(50, 100) == 0.05
    assert ask(0, 100) is None and ask(float("nan"), 0) is None and ask(True, 0) is None  # ignored: the setting


def test_load_deadline_reaches_the_worker(engines: Callable[..., Engine]) -> None:
    a, b = engines(), engines()
    a.prefill("a", PROMPT)
    run = b.prefill("b", PROMPT, params={"lmcache_load_deadline_ms": 30_000})
    assert [m.load_deadlines for m in b.log if m.load_deadlines] == [{"b": 30.0}]
    assert run["external"] == 40 and not b.load_errors


def test_save_decode_cache_stores_the_generated_tokens_chunks(engines: Callable[..., Engine]) -> None:
    """A later turn whose prompt is this prompt plus the generated text loads both."""
    prompt, generated = list(range(2000, 2020)), list(range(3000, 3014))  # 20 + 14 = 34 tokens: 4 full chunks
    a, b = engines(save_decode_cache=True), engines()
    a.prefill("a", prompt, decode=generated)
    turn2 = prompt + generated + [7, 7, 7]
    run = b.prefill("b", turn2)
    assert run["external"] == 32
    for layer in range(LAYERS):
        assert torch.equal(b.rows(run["blocks"], 0, 32, layer), expected_rows(turn2, 0, 32, layer, torch.float16))
    # Without the setting, or with the request saying no, only the prompt's 2 full chunks are stored.
    c, e = engines(tenant="no-setting"), engines(tenant="no-setting")
    c.prefill("c", prompt, decode=generated)
    assert e.ask(Request("e", turn2)) == 16
    d, f = engines(tenant="said-no", save_decode_cache=True), engines(tenant="said-no")
    d.prefill("d", prompt, decode=generated, params={"lmcache_save_decode_cache": False})
    assert f.ask(Request("f", turn2)) == 16


def test_new_settings_are_validated() -> None:
    assert ConnectorSettings.from_extra_config({"save_decode_cache": "true"}).save_decode_cache is True
    for bad in ({"max_store_tokens": -1}, {"load_deadline_ms": -5}, {"max_queued_saves": 0}):
        with pytest.raises(ValueError, match="kv_connector_extra_config"):
            ConnectorSettings.from_extra_config(bad)


def test_a_preemption_waits_for_the_saves_reading_its_blocks(
    engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM hands a preempted request's blocks out in the same step: handle_preemptions
    (before the forward pass) returns only once the saves reading them are done."""
    gate, entered = threading.Event(), threading.Event()
    original = WorkerSide.save_one

    def held_save(self: WorkerSide, request: object, transfer: object, staged: object = None) -> tuple[int, float]:
        entered.set()
        gate.wait(30)
        return original(self, request, transfer, staged)  # type: ignore[arg-type]

    monkeypatch.setattr(WorkerSide, "save_one", held_save)
    engine = engines()
    prompt = list(range(4000, 4020))
    blocks = engine.alloc(20)
    request = Request("p", prompt)
    assert engine.ask(request) == 0
    engine.scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: (blocks,)), 0)
    out = SchedulerOutput([NewRequestData("p", prompt, (blocks,), 0)], num_scheduled_tokens={"p": 20})
    engine.step(out, [(prompt, blocks, 0, 20)])  # the save of 2 chunks is queued, held at the gate
    assert entered.wait(30)
    done = threading.Event()
    other = LMCacheServerConnectorMetadata(preempted=["other"])
    engine.worker.handle_preemptions(other)  # no save of that request: returns at once
    preempt = LMCacheServerConnectorMetadata(preempted=["p"])
    thread = threading.Thread(target=lambda: (engine.worker.handle_preemptions(preempt), done.set()))
    thread.start()
    assert not done.wait(0.3), "handle_preemptions returned while a save still read the blocks"
    gate.set()
    assert done.wait(30)
    thread.join()


def test_cost_gate_learns_both_rates_and_skips_slow_loads() -> None:
    now = [0.0]
    gate = CostGate(margin=1.0, clock=lambda: now[0])
    for _ in range(3):  # 1000 prefill tokens per 0.1 s step: 10k tokens/s
        gate.saw_step(1000)
        now[0] += 0.1
        gate.saw_step(1)  # a decode step: not a prefill sample
        now[0] += 0.01
    assert gate.pays(500), "not ready: the load rate is still unknown"
    for _ in range(3):
        gate.saw_load(1000, 0.5)  # 2k tokens/s: five times slower than computing
    assert gate.ready and gate.prefill_rate == pytest.approx(10_000) and gate.load_rate == pytest.approx(2000)
    assert not gate.pays(500)
    assert CostGate(margin=10.0).pays(500)  # not ready
    lenient = CostGate(margin=6.0, clock=lambda: now[0])
    lenient.load_rate, lenient.prefill_rate = 2000.0, 10_000.0
    lenient._load_samples = lenient._prefill_samples = 3
    assert lenient.pays(500)


def test_cost_gate_skips_the_load_and_counts_it(engines: Callable[..., Engine]) -> None:
    a, b = engines(), engines(cost_gate=True)
    a.prefill("a", PROMPT)
    side = b.scheduler.scheduler
    assert side is not None and side.cost_gate is not None
    assert b.ask(Request("fast", PROMPT)) == 40  # no rates yet: loads run
    side.cost_gate.load_rate, side.cost_gate.prefill_rate = 1_000.0, 50_000.0
    side.cost_gate._load_samples = side.cost_gate._prefill_samples = 3
    assert b.ask(Request("slow", PROMPT)) == 0
    assert side.stats["loads_skipped_by_cost"] == 1


def test_prefetch_makes_a_disk_hit_a_memory_hit_at_load_time(disk_daemon: Any) -> None:
    """The lookup of a request whose chunks only the disk holds carries ``prefetch``: the
    daemon promotes them while the request waits, and its load is a memory hit."""
    daemon = disk_daemon(cache_policy="lru")
    a = Engine(daemon.address, "prefetch")
    try:
        a.prefill("a", PROMPT)  # 5 chunks of 1 KiB into memory; pushed out to disk below
        with daemon.client() as c:
            for _ in range(18):
                assert c.put([os.urandom(KEY_BYTES)], [os.urandom(512 * 1024)]) == [PutStatus.STORED]
            wait_for(lambda: disk_stats(c)["queued_spills"] == 0)
    finally:
        a.scheduler.shutdown()
        a.worker.shutdown()
    assert daemon.stop() == 0
    daemon.start()  # memory starts empty (no warm restart in tests); the disk index is rebuilt
    b = Engine(daemon.address, "prefetch")
    try:
        namespace = b.worker.worker.transfer.namespace  # type: ignore[union-attr]
        keys = chunk_keys(PROMPT, 8)
        with daemon.client() as c:
            assert c.lookup(keys, namespace=namespace).tiers == ["disk"] * 5
            request = Request("b", PROMPT)
            assert b.ask(request) == 40  # the lookup with prefetch
            wait_for(lambda: c.lookup(keys, namespace=namespace).tiers == ["memory"] * 5)
            disk_hits, memory_hits = disk_stats(c)["hits"], c.stats()["tiers"]["memory"]["hits"]
            blocks = b.alloc(len(PROMPT))
            b.scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: (blocks,)), 40)
            b.until(lambda: "b" in b.finished_recving, "load of b")
            assert not b.load_errors
            assert disk_stats(c)["hits"] == disk_hits
            assert c.stats()["tiers"]["memory"]["hits"] == memory_hits + 5
        for layer in range(LAYERS):
            assert torch.equal(b.rows(blocks, 0, 40, layer), expected_rows(PROMPT, 0, 40, layer, torch.float16))
    finally:
        b.scheduler.shutdown()
        b.worker.shutdown()


@pytest.mark.parametrize("batch_copies", ["off", "on"])
@pytest.mark.parametrize("seed", range(4))
def test_random_orders_of_async_transfers_never_write_a_wrong_byte(
    engines: Callable[..., Engine], address: str, seed: int, batch_copies: str
) -> None:
    """Model-based: random prompts sharing prefixes, random engines, chunked-prefill step
    sizes, local prefix hits, chunks deleted between lookup and load, and per-request
    skips, run through the asynchronous protocol in random order.  After every request,
    each token the connector loaded holds exactly the KV of that token (a chunk deleted
    after the lookup is recomputed, never garbage), and what vLLM computed itself is its own.
    ``batch_copies: on`` runs the loads' batched copies (copied at each batch's flush,
    before its leases end), which a CPU cache leaves off by default."""
    rng = random.Random(seed)
    tenant = f"model-{seed}-{batch_copies}"
    pool = [
        engines(tenant=tenant, batch_copies=batch_copies),
        engines(tenant=tenant, save_decode_cache=True, batch_copies=batch_copies),
    ]
    assert all((e.worker.worker.cache.batches is not None) == (batch_copies == "on") for e in pool)  # type: ignore[union-attr]
    bases = [list(range(5000 + 100 * b, 5000 + 100 * b + 48)) for b in range(3)]
    for step in range(24):
        engine = rng.choice(pool)
        prompt = rng.choice(bases)[: rng.randrange(9, 49)] + [
            rng.randrange(2, 900) for _ in range(rng.randrange(0, 12))
        ]
        params = {"lmcache_skip_save": True} if rng.random() < 0.1 else None
        req_id = f"r{seed}-{step}"
        if rng.random() < 0.25:  # something else evicts one of the prompt's chunks first
            keys = chunk_keys(prompt, 8)
            if keys:
                ns = engine.worker.worker.transfer.namespace  # type: ignore[union-attr]
                with CacheClient(address, fail_open=False) as c:
                    c.delete([rng.choice(keys)], namespace=ns)
        local = 4 * rng.randrange(0, 3) if rng.random() < 0.3 else 0  # vLLM's own prefix hit, block aligned
        local = min(local, max(0, len(prompt) - 1) // 4 * 4)
        engine.load_errors = set()
        run = engine.prefill(
            req_id, prompt, local_hit=local, step_tokens=rng.choice([5, 8, 13, 64]), params=params, fill_local=True
        )
        loaded_end = local + run["external"]
        failed_from = min((run["blocks"].index(b) * 4 for b in engine.load_errors if b in run["blocks"]), default=None)
        good_end = loaded_end if failed_from is None else max(local, min(loaded_end, failed_from))
        for layer in range(LAYERS):
            if good_end > local:
                got = engine.rows(run["blocks"], local, good_end, layer)
                assert torch.equal(got, expected_rows(prompt, local, good_end, layer, torch.float16)), (seed, step)
            computed = sorted(set(run["computed"]))
            if computed:
                lo, hi = computed[0], computed[-1] + 1
                assert torch.equal(
                    engine.rows(run["blocks"], lo, hi, layer), expected_rows(prompt, lo, hi, layer, torch.float16)
                )
        engine.free.extend(run["blocks"])  # vLLM reuses freed blocks: stale bytes must never pass as loaded


def test_ttl_and_retention_are_refused_and_the_request_not_stored(
    engines: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    """The daemon keeps no per-chunk TTL or retention class: a request asking for one
    still loads, but nothing of it is stored (never kept longer than asked)."""

    def read(params: dict[str, object]) -> RequestParams:
        return request_params(SimpleNamespace(request_id="r", kv_transfer_params=params))

    with caplog.at_level(logging.WARNING, logger="lmcache_client.integrations.vllm.params"):
        assert read({"lmcache_ttl_s": 60}).skip_save
        assert read({"lmcache_skip_save": False, "lmcache_retention": "short"}).skip_save
        assert read({"lmcache_retention": "short", "lmcache_skip_save": False}).skip_save
        assert "refused" in caplog.text and "no per-chunk TTL" in caplog.text
        caplog.clear()
        assert read({"lmcache_ttl_s": -1, "lmcache_retention": ""}) == RequestParams()  # bad values: ignored
        assert "ignoring kv_transfer_params lmcache_ttl_s" in caplog.text and "refused" not in caplog.text
    a, b = engines(), engines()
    a.prefill("a", PROMPT)
    run = b.prefill("b", PROMPT + [7] * 16, params={"lmcache_ttl_s": 30})
    assert run["external"] == 40 and saved_keys(run) == 0
    other = b.prefill("c", PROMPT + [8] * 16)
    assert saved_keys(other) > 0
