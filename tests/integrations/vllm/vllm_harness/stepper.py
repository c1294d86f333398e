"""Step-by-step offline vLLM for the asynchronous-connector tests (runs in vLLM's own venv).

``python -m tests.integrations.vllm.vllm_harness.stepper SPEC.json OUT.json`` builds one
``vllm.LLM`` (engine core in this process), then:

1. ``warm``: generates each warm prompt (its chunks go to the daemon) and waits
   until the connector's saves are done;
2. ``decode`` starts and decodes; once it has a token, ``load`` is added: its
   chunks are in the daemon (not in vLLM's own prefix cache, which is off), so
   the connector loads them;
3. the engine is stepped until both finish.

The load is *gated*: the connector's ``WorkerSide.load_one`` waits for a gate
before it reads anything, like a load through a slow link.  The gate opens
once ``decode`` has produced ``hold_tokens`` tokens while the load was in
flight, or after ``gate_timeout_s`` (a synchronous load holds the whole step,
so nothing is produced meanwhile).  With ``kill_daemon_pid`` the daemon is
SIGKILLed while the gate is closed (the load then fails and is recomputed).
With ``slow_scatter_after`` N, each chunk a load writes after the first N
waits ``slow_scatter_s`` (a load that misses its deadline part way).

OUT holds each request's tokens, ``decode_tokens_during_load`` (tokens of
``decode`` produced in steps that ended with the load in flight) and the
connector's counters.  Tests compare the tokens with plain vLLM's.  The
``batch`` scenario (:func:`run_batch`) runs prompts together on a small KV
cache instead, to force preemptions while saves are in flight.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from .replica import _connectors, _counters, _track_scheduler_connectors, settle  # noqa: E402


class Gate:
    """Holds every load at its start until opened; tells whether one is in flight."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.opened = threading.Event()
        self.in_flight = 0
        self.held = 0

    def install(self) -> None:
        from lmcache_client.integrations.vllm.worker import WorkerSide

        original = WorkerSide.load_one
        gate = self

        def load_one(side: Any, request: Any, transfer: Any, deadline: float | None = None) -> Any:
            gate.in_flight += 1
            gate.held += 1
            try:
                gate.opened.wait(gate.timeout_s)
                return original(side, request, transfer, deadline)
            finally:
                gate.in_flight -= 1

        WorkerSide.load_one = load_one  # type: ignore[method-assign]


def slow_scatters(after: int, seconds: float) -> None:
    """Every chunk a load scatters after the first ``after`` waits ``seconds`` first (a
    load slower than its deadline: the chunks that came in time are used)."""
    from lmcache_client.integrations.paged import PagedCopier

    original = PagedCopier.scatter
    count = [0]

    def scatter(copier: Any, slots: Any, src: Any) -> None:
        count[0] += 1
        if count[0] > after:
            time.sleep(seconds)
        original(copier, slots, src)

    PagedCopier.scatter = scatter  # type: ignore[method-assign]


def run_batch(llm: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """``batch``: every prompt at once on a KV cache too small for them all, so vLLM
    preempts; with ``hold_saves_until_preemption`` no save reads anything before the
    first preemption, so the preempted request's saves are certainly in flight when
    vLLM hands its blocks out.  Counts the preemptions the connector saw and the
    saves still in flight for them (``handle_preemptions``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from lmcache_client.integrations.vllm.connector import LMCacheServerConnectorV1
    from lmcache_client.integrations.vllm.worker import WorkerSide

    seen = {"preempted": 0, "saves_in_flight_at_preemption": 0}
    original_handle = LMCacheServerConnectorV1.handle_preemptions
    original_save = WorkerSide.save_one

    held = threading.Event()
    if not spec.get("hold_saves_until_preemption"):
        held.set()

    def handle_preemptions(connector: Any, meta: Any) -> None:
        preempted = list(getattr(meta, "preempted", []) or [])
        if preempted and connector.transfers is not None:
            seen["preempted"] += len(preempted)
            seen["saves_in_flight_at_preemption"] += sum(
                1 for req_id in preempted for _, f in connector.transfers._saves.get(req_id, ()) if not f.done()
            )
            held.set()  # the saves go on; the connector must wait for them before the forward pass
        original_handle(connector, meta)

    def save_one(side: Any, request: Any, transfer: Any, staged: Any = None) -> Any:
        held.wait(120)
        return original_save(side, request, transfer, staged)

    LMCacheServerConnectorV1.handle_preemptions = handle_preemptions  # type: ignore[method-assign]
    WorkerSide.save_one = save_one  # type: ignore[method-assign]
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=spec["max_tokens"])
    for i, prompt in enumerate(spec["prompts"]):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=prompt), params)
    tokens: dict[str, list[int]] = {}
    deadline = time.monotonic() + 600
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise TimeoutError("the batch did not finish")
        for output in engine.step():
            tokens[output.request_id] = list(output.outputs[0].token_ids)
    settle(llm)
    return {"tokens": [tokens[str(i)] for i in range(len(spec["prompts"]))], **seen, "counters": _counters()}


def main(argv: list[str]) -> int:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(argv[0]).read_text())
    out_path = Path(argv[1])
    _track_scheduler_connectors()
    gate = Gate(spec.get("gate_timeout_s", 3.0))
    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "dtype": spec.get("dtype", "float32"),
        "max_model_len": spec.get("max_model_len", 4096),
        "enforce_eager": True,
        "distributed_executor_backend": "uni",
        "enable_prefix_caching": False,
        "seed": 0,
    }
    if spec.get("connector"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["connector"])
    if spec.get("num_blocks"):
        kwargs["num_gpu_blocks_override"] = spec["num_blocks"]
    llm = LLM(**kwargs)
    if spec.get("scenario") == "batch":
        out_path.write_text(json.dumps(run_batch(llm, spec)))
        return 0
    engine = llm.llm_engine
    greedy = {"temperature": 0.0, "ignore_eos": True}
    for tokens in spec.get("warm", []):
        llm.generate([TokensPrompt(prompt_token_ids=tokens)], SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
        settle(llm)
    gate.install()
    if spec.get("slow_scatter_after") is not None:
        slow_scatters(spec["slow_scatter_after"], spec["slow_scatter_s"])
    engine.add_request(
        "decode",
        TokensPrompt(prompt_token_ids=spec["decode"]),
        SamplingParams(**greedy, max_tokens=spec["decode_max_tokens"]),
    )
    tokens: dict[str, list[int]] = {"decode": [], "load": []}
    during = 0
    added = False
    deadline = time.monotonic() + 600
    while engine.has_unfinished_requests() or not added:
        if time.monotonic() > deadline:
            raise TimeoutError("the requests did not finish")
        before = len(tokens["decode"])
        for output in engine.step():
            tokens[output.request_id] = list(output.outputs[0].token_ids)
        if gate.in_flight and not gate.opened.is_set():
            during += len(tokens["decode"]) - before
            if during >= spec.get("hold_tokens", 3):
                if spec.get("kill_daemon_pid"):
                    os.kill(spec["kill_daemon_pid"], signal.SIGKILL)
                gate.opened.set()
        if not added and tokens["decode"]:
            engine.add_request(
                "load",
                TokensPrompt(prompt_token_ids=spec["load"]),
                SamplingParams(**greedy, max_tokens=spec["load_max_tokens"]),
            )
            added = True
        if not engine.has_unfinished_requests() and added:
            break
    gate.opened.set()
    settle(llm)
    worker, scheduler = _connectors()
    result = {
        "tokens": tokens,
        "decode_tokens_during_load": during,
        "loads_gated": gate.held,
        "counters": _counters(),
        "scheduler_stats": dict(scheduler.scheduler.stats) if scheduler is not None else {},
    }
    costs = scheduler.scheduler.cost_gate if scheduler is not None else None
    if costs is not None:  # what the cost gate learned from vLLM's steps and the workers' stats
        result["cost_gate"] = {"prefill_rate": costs.prefill_rate, "tier_cost": costs.tier_cost,
                               "tier_samples": costs.tier_samples}  # fmt: skip
    out_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
