"""Tensor parallelism 2 in real vLLM (runs in vLLM's own venv; two worker processes).

``python -m tests.integrations.vllm.vllm_harness.tp SPEC.json OUT.json``: one
``vllm.LLM`` with ``tensor_parallel_size=2`` (the ``mp`` executor: a process per
rank), vLLM's own prefix cache off, answers ``SPEC["prompt"]`` twice.  With the
connector the second answer is loaded from the daemon: each rank its own
shard, the asynchronous load finished once both ranks report it.  OUT holds
each answer's tokens and ``num_cached_tokens``.  Optional ``SPEC["compilation_config"]``
and ``SPEC["attention_backend"]`` are passed to ``vllm.LLM``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def main(argv: list[str]) -> int:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(argv[0]).read_text())
    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "dtype": "float32",
        "max_model_len": 2048,
        "enforce_eager": True,
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "mp",
        "enable_prefix_caching": False,
        "seed": 0,
    }
    if spec.get("compilation_config"):
        kwargs["compilation_config"] = spec["compilation_config"]
    if spec.get("attention_backend"):
        kwargs["attention_backend"] = spec["attention_backend"]
    if spec.get("connector"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["connector"])
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    answers = []
    for _ in range(2):
        [out] = llm.generate([TokensPrompt(prompt_token_ids=spec["prompt"])], params, use_tqdm=False)
        answers.append({"tokens": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens})
    Path(argv[1]).write_text(json.dumps({"answers": answers}))
    return 0


if __name__ == "__main__":  # the mp executor spawns its workers: they import this module
    sys.exit(main(sys.argv[1:]))
