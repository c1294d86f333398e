"""One offline vLLM replica process for the real-vLLM tests (runs in vLLM's own venv).

``python -m tests.integrations.vllm.vllm_harness.replica SPEC.json OUT.json`` runs, in one
process, each entry of ``SPEC["runs"]`` in order: a fresh ``vllm.LLM`` (with
or without the lmcache-server connector), greedy generation of the entry's
token prompts one request at a time, then the LLM is torn down.  It writes,
per run, the generated tokens of each prompt, vLLM's ``num_cached_tokens``
per prompt, and the connector's own counters (worker and scheduler) after
each prompt, as JSON.  The engine core and the worker run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, uni executor) so each LLM costs
seconds, not the ~45 s of a three-process start; the OpenAI-server tests
cover the multi-process engine.

A run entry: ``name``, ``model`` (checkpoint dir), ``dtype``, ``prompts``
(lists of token ids), ``max_tokens``, ``prefix_caching`` (bool),
``connector`` (None for plain vLLM, else the kv-transfer-config dict),
optional ``max_model_len``, ``block_size``, ``compilation_config``, ``attention_backend``
(vLLM's backend name, e.g. ``CPU_MLA``), ``hma`` (True/False: vLLM's hybrid
KV cache manager on/off; absent: vLLM decides), ``kv_transfer_params`` (every
request's, the per-request control), ``pause_before`` (a file to wait
for before the run starts, and ``pause_after_prompt`` an index after which
``SPEC_DIR/<name>.paused`` is written and ``<name>.resume`` awaited: the test
kills or restarts the daemon in between), ``may_refuse`` (True: an LLM that fails to start is
recorded as ``start_error``, the text of the whole exception chain, and the process goes on;
put such a run last in its process).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _connectors() -> tuple[Any, Any]:
    """The worker-side and scheduler-side connector objects of this process."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    return worker, _SCHEDULER_CONNECTORS[-1] if _SCHEDULER_CONNECTORS else None


_SCHEDULER_CONNECTORS: list[Any] = []


def _track_scheduler_connectors() -> None:
    """Remember each scheduler-side connector built in this process (they are
    otherwise buried in the engine core)."""
    from lmcache_client.integrations.vllm import connector as vllm_connector

    original = vllm_connector.LMCacheServerConnectorV1.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if self.scheduler is not None:
            _SCHEDULER_CONNECTORS.append(self)

    vllm_connector.LMCacheServerConnectorV1.__init__ = init  # type: ignore[method-assign]


def _counters() -> dict[str, Any]:
    worker, scheduler = _connectors()
    out: dict[str, Any] = {}
    if worker is not None and getattr(worker, "worker", None) is not None:
        side = worker.worker
        totals = dict(side.totals)
        for name, value in dataclasses.asdict(side.stats).items():
            totals[name] = totals.get(name, 0) + value
        out["worker"] = totals
        out["worker_client"] = worker.client.fail_open_stats
        out["layout"] = side.engine.describe() if side.engine is not None else None
    if scheduler is not None:
        out["scheduler_client"] = scheduler.client.fail_open_stats
    return out


def _kv_cache(llm: Any) -> dict[str, Any]:
    """vLLM's KV cache capacity (blocks) and its groups' spec kinds, as the scheduler sees them."""
    config = llm.llm_engine.vllm_config
    out: dict[str, Any] = {
        "num_blocks": config.cache_config.num_gpu_blocks,
        "hma": not config.scheduler_config.disable_hybrid_kv_cache_manager,
    }
    scheduler = getattr(getattr(llm.llm_engine.engine_core, "engine_core", None), "scheduler", None)
    kv_cache_config = getattr(scheduler, "kv_cache_config", None)
    if kv_cache_config is not None:
        out["groups"] = [type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups]
    return out


def settle(llm: Any, timeout_s: float = 120) -> None:
    """Step the engine until the connector's asynchronous loads and saves are done and
    reported (vLLM keeps stepping for them; an offline ``generate`` returns before),
    so the counters read next are the prompt's."""
    worker, _ = _connectors()
    transfers = getattr(worker, "transfers", None)
    if transfers is None:
        return
    deadline = time.monotonic() + timeout_s
    while transfers.in_flight != (0, 0) or transfers.save_lane.pending or transfers.load_lane.pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"transfers still in flight after {timeout_s} s: {transfers.in_flight}")
        llm.llm_engine.step()
        time.sleep(0.001)


def _wait_for(path: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def run_one(entry: dict[str, Any], spec_dir: Path) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {
        "model": entry["model"],
        "dtype": entry.get("dtype", "float32"),
        "max_model_len": entry.get("max_model_len", 4096),
        "enforce_eager": True,
        "distributed_executor_backend": "uni",
        "enable_prefix_caching": entry.get("prefix_caching", True),
        "seed": 0,
    }
    if entry.get("block_size"):
        kwargs["block_size"] = entry["block_size"]
    if entry.get("max_num_batched_tokens"):  # a prompt longer than this is prefilled over several steps
        kwargs["max_num_batched_tokens"] = entry["max_num_batched_tokens"]
    if entry.get("mamba_ssm_cache_dtype"):  # the same Mamba state shapes on every CPU
        kwargs["mamba_ssm_cache_dtype"] = entry["mamba_ssm_cache_dtype"]
    if entry.get("compilation_config"):
        kwargs["compilation_config"] = entry["compilation_config"]
    if entry.get("attention_backend"):
        kwargs["attention_backend"] = entry["attention_backend"]
    if entry.get("connector"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**entry["connector"])
    if entry.get("hma") is not None:
        kwargs["disable_hybrid_kv_cache_manager"] = not entry["hma"]
    started = time.monotonic()
    try:
        llm = LLM(**kwargs)
    except Exception as err:
        if not entry.get("may_refuse"):
            raise
        text = "".join(traceback.format_exception(err))
        return {"name": entry["name"], "start_error": text, "prompts": []}
    result: dict[str, Any] = {"name": entry["name"], "startup_s": time.monotonic() - started, "prompts": []}
    result["kv_cache"] = _kv_cache(llm)
    extra_args = {"kv_transfer_params": entry["kv_transfer_params"]} if entry.get("kv_transfer_params") else None
    params = SamplingParams(
        temperature=0.0, max_tokens=entry.get("max_tokens", 8), ignore_eos=True, extra_args=extra_args
    )
    try:
        for i, tokens in enumerate(entry["prompts"]):
            t0 = time.monotonic()
            [out] = llm.generate([TokensPrompt(prompt_token_ids=list(tokens))], params, use_tqdm=False)
            settle(llm)
            result["prompts"].append(
                {
                    "tokens": list(out.outputs[0].token_ids),
                    "num_cached_tokens": out.num_cached_tokens,
                    "latency_s": time.monotonic() - t0,
                    "counters": _counters(),
                }
            )
            if entry.get("pause_after_prompt") == i:
                (spec_dir / f"{entry['name']}.paused").write_text("paused")
                _wait_for(spec_dir / f"{entry['name']}.resume")
    finally:
        del llm
        gc.collect()
    return result


def main(argv: list[str]) -> int:
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    _track_scheduler_connectors()
    results = []
    for entry in spec["runs"]:
        if entry.get("pause_before"):
            _wait_for(Path(entry["pause_before"]))
        results.append(run_one(entry, spec_path.parent))
        out_path.write_text(json.dumps({"runs": results}))  # what is done so far, for a failing test to show
        print(f"replica: run {entry['name']} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
