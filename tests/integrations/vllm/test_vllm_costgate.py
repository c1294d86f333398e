"""The cost gate per daemon tier (issue 30 item 4): rates learned per tier, and a load
whose slower-tier part would take longer than computing it is cut to its faster part.
Unit tests of :class:`CostGate`, then the scheduler connector on a real daemon whose
chunks sit partly in memory, partly on disk."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lmcache_client import PutStatus, chunk_keys  # noqa: E402
from lmcache_client.integrations.vllm.scheduler import CostGate  # noqa: E402
from lmcache_client.protocol import KEY_BYTES  # noqa: E402

from ...conftest import disk_stats, wait_for  # noqa: E402
from .vllm_harness.engine import LAYERS, Engine, Request, expected_rows  # noqa: E402

PROMPT = list(range(3000, 3041))  # 5 full chunks of 8 + 1


def primed(margin: float = 1.0, prefill_rate: float = 10_000.0) -> CostGate:
    """A gate that has seen three prefill steps at ``prefill_rate`` tokens/s."""
    now = [0.0]
    gate = CostGate(margin, clock=lambda: now[0])
    for _ in range(CostGate.MIN_SAMPLES + 1):
        gate.saw_step(1000)
        now[0] += 1000 / prefill_rate
    assert gate.prefill_rate == pytest.approx(prefill_rate)
    return gate


def test_each_tier_learns_its_own_rate_from_pure_and_mixed_samples() -> None:
    gate = primed()
    for _ in range(3):
        gate.saw_load(1000, 0.01, {"memory": 1000})  # 100k tokens/s
    for _ in range(3):
        gate.saw_load(1000, 0.5, {"disk": 1000})  # 2k tokens/s
    assert 1 / gate.cost("memory") == pytest.approx(100_000)  # type: ignore[operator]
    assert 1 / gate.cost("disk") == pytest.approx(2000)  # type: ignore[operator]
    # A mixed sample, both known: each scaled by what the sample says (twice as slow).
    memory, disk = gate.cost("memory"), gate.cost("disk")
    gate.saw_load(2000, 2 * (1000 * memory + 1000 * disk), {"memory": 1000, "disk": 1000})  # type: ignore[operator]
    assert gate.cost("memory") == pytest.approx(memory * 1.2)  # type: ignore[operator]
    assert gate.cost("disk") == pytest.approx(disk * 1.2)  # type: ignore[operator]
    # A mixed sample with one unknown tier: what the known tier explains is its, the rest the new one's.
    fresh = primed()
    for _ in range(3):
        fresh.saw_load(100, 0.001, {"memory": 100})
    fresh.saw_load(200, 0.001 + 0.1, {"memory": 100, "redis": 100})
    assert fresh.tier_cost["redis"] == pytest.approx(0.001)
    assert fresh.tier_samples["memory"] == 3  # the mixed sample taught memory nothing
    # Under tensor parallelism every rank counts its tokens: the mix is scaled to them.
    tp = primed()
    tp.saw_load(2000, 1.0, {"disk": 1000})
    assert tp.tier_cost["disk"] == pytest.approx(1 / 2000)
    # Nothing usable: no sample.
    tp.saw_load(0, 1.0, {"disk": 10})
    tp.saw_load(10, 0.0, {"disk": 10})
    assert tp.tier_samples["disk"] == 1


def test_plan_keeps_the_leading_run_that_saves_the_most() -> None:
    gate = primed()  # computing: 100 us/token
    for _ in range(3):
        gate.saw_load(1000, 0.01, {"memory": 1000})  # 10 us/token
        gate.saw_load(1000, 0.5, {"disk": 1000})  # 500 us/token
    assert gate.plan([("memory", 8), ("memory", 8), ("disk", 8), ("disk", 8)]) == 16
    assert gate.plan([("disk", 8), ("disk", 8)]) == 0
    assert gate.plan([("memory", 8)]) == 8
    # A slow chunk before many fast ones: the run as a whole pays.
    assert gate.plan([("disk", 8)] + [("memory", 8)] * 10) == 88
    # A tier never measured falls back to the global rate (every sample so far).
    assert gate.cost("redis") == pytest.approx(1 / gate.load_rate)  # type: ignore[operator]
    # margin: loading may take up to margin times computing.
    lenient = primed(margin=6.0)
    for _ in range(3):
        lenient.saw_load(1000, 0.5, {"disk": 1000})
    assert lenient.plan([("disk", 8)]) == 8
    # No prefill rate yet: everything loads.
    assert CostGate().plan([("disk", 8), ("memory", 3)]) == 11
    with pytest.raises(ValueError, match="margin"):
        CostGate(margin=0)


def _disk_then_memory(daemon_factory: Any) -> Any:
    """A daemon holding PROMPT's 5 chunks on disk, its first 2 promoted back into memory."""
    daemon = daemon_factory(cache_policy="lru")
    a = Engine(daemon.address, "costgate")
    try:
        a.prefill("a", PROMPT)
        with daemon.client() as c:
            for _ in range(18):  # push them out to disk
                assert c.put([os.urandom(KEY_BYTES)], [os.urandom(512 * 1024)]) == [PutStatus.STORED]
            wait_for(lambda: disk_stats(c)["queued_spills"] == 0)
        namespace = a.worker.worker.transfer.namespace  # type: ignore[union-attr]
    finally:
        a.scheduler.shutdown()
        a.worker.shutdown()
    assert daemon.stop() == 0
    daemon.start()  # memory starts empty; the disk index is rebuilt
    keys = chunk_keys(PROMPT, 8)
    with daemon.client() as c:
        assert c.lookup(keys, namespace=namespace).tiers == ["disk"] * 5
        c.lookup(keys[:2], namespace=namespace, prefetch=True)
        wait_for(lambda: c.lookup(keys, namespace=namespace).tiers == ["memory"] * 2 + ["disk"] * 3)
    return daemon


def test_the_disk_part_of_a_load_is_computed_when_disk_is_slower(disk_daemon: Any) -> None:
    daemon = _disk_then_memory(disk_daemon)
    b = Engine(daemon.address, "costgate", cost_gate=True, prefetch=False)
    try:
        side = b.scheduler.scheduler
        assert side is not None and side.cost_gate is not None
        gate = side.cost_gate
        now = [0.0]
        gate._clock = lambda: now[0]
        for _ in range(4):  # the engine computes 10k tokens/s
            gate.saw_step(1000)
            now[0] += 0.1
        # What the workers reported: memory loads fast, disk loads slowly (its mix from the lookup).
        for _ in range(3):
            gate.saw_load(800, 0.008, {"memory": 800})
            gate.saw_load(800, 0.8, {"disk": 800})
        run = b.prefill("b", PROMPT)
        assert run["external"] == 16  # the two memory chunks; the disk ones are computed
        assert run["computed"] == list(range(16, 41))
        assert [(load.start_token, load.end_token, len(load.keys)) for load in run["loads"]] == [(0, 16, 2)]
        stats = side.take_stats()
        assert stats["loads_cut_by_cost"] == 1 and stats["loads_skipped_by_cost"] == 0
        assert stats["load_tokens_skipped_by_cost"] == 40 - 16
        for layer in range(LAYERS):
            assert torch.equal(b.rows(run["blocks"], 0, 16, layer), expected_rows(PROMPT, 0, 16, layer, torch.float16))
        # Disk now as fast as memory: the whole load runs.
        for _ in range(30):
            gate.saw_load(800, 0.008, {"disk": 800})
        assert b.ask(Request("c", PROMPT)) == 40
        assert side.take_stats()["load_tokens_skipped_by_cost"] == 0
    finally:
        b.scheduler.shutdown()
        b.worker.shutdown()


def test_the_scheduler_learns_tier_rates_from_the_workers_stats(disk_daemon: Any) -> None:
    """The tier mix of a finished load comes from its lookup answer; the seconds from the
    workers' stats of the step that reports it finished."""
    daemon = _disk_then_memory(disk_daemon)
    b = Engine(daemon.address, "costgate", cost_gate=True, prefetch=False)
    try:
        side = b.scheduler.scheduler
        assert side is not None and side.cost_gate is not None
        request = Request("b", PROMPT)
        assert b.ask(request) == 40
        blocks = b.alloc(len(PROMPT))
        b.scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: (blocks,)), 40)
        assert side._costs.load_mix["b"] == {"memory": 16, "disk": 24}
        side._costs.measured = []  # what the harness's steps report is not under test here
        side.loads_finished({"b"})
        side.saw_output(SimpleNamespace(data={"loaded_tokens": 40, "load_s": 0.04}))
        gate = side.cost_gate
        assert gate.tier_samples == {"memory": 1, "disk": 1} and "b" not in side._costs.load_mix
        assert gate.tier_cost == {"memory": pytest.approx(0.001), "disk": pytest.approx(0.001)}
    finally:
        b.scheduler.shutdown()
        b.worker.shutdown()
