"""Mamba / GDN recurrent state keyed by exact prefix length (lmcache_client.integrations.vllm.mamba).

The key rules run here; the layout, the copies and a round trip through a real
daemon run in vLLM's venv against vLLM's own ``MambaSpec``, ``KVCacheConfig``
and state-shape calculators (vllm_harness/mamba_state.py), because the state's
geometry is vLLM's to define.  Not yet wired into the connector (see
docs/integrations.md, "Mamba / GDN hybrids").
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from lmcache_client.integrations.vllm.mamba import state_after_step, state_key, state_key_after, state_slot
from lmcache_client.keys import ROOT_KEY, chunk_keys, salted_root, tail_key

from ...conftest import Daemon
from .vllm_harness.fixtures import Forkserver, run_harness, tokens

CHUNK = 256


def test_a_state_key_names_the_exact_prefix_length() -> None:
    """Every length of one prompt has its own key (so a state is never used at another
    length), whether it ends on a chunk boundary or not; tokens after the prefix do not
    change it; every token inside it does."""
    prompt = tokens(1200, seed=1)
    lengths = [1, 255, 256, 257, 511, 512, 768, 1152, 1199]
    keys = [state_key(prompt, n, CHUNK) for n in lengths]
    assert len(set(keys)) == len(lengths)
    longer = prompt + tokens(50, seed=2)
    assert [state_key(longer, n, CHUNK) for n in lengths] == keys
    for n in (256, 1152):
        changed = list(prompt)
        changed[0] = changed[0] % 1000 + 3 if changed[0] != changed[0] % 1000 + 3 else changed[0] + 1
        assert state_key(changed, n, CHUNK) != state_key(prompt, n, CHUNK)
        changed = list(prompt)
        changed[n - 1] += 1
        assert state_key(changed, n, CHUNK) != state_key(prompt, n, CHUNK)


def test_a_state_key_is_the_chunk_chain_plus_the_rest_and_never_a_chunk_or_tail_key() -> None:
    prompt = tokens(1200, seed=3)
    chain = chunk_keys(prompt, CHUNK)
    n = 1152  # 4 full chunks + 128 tokens
    assert state_key(prompt, n, CHUNK) == state_key_after(chain[3], prompt[1024:1152], n)
    assert state_key(prompt, 1024, CHUNK) == state_key_after(chain[3], [], 1024)
    every_state = {state_key(prompt, m, CHUNK) for m in range(1, 1201, 7)}
    assert not every_state & set(chain)
    assert state_key(prompt, n, CHUNK) != tail_key(chain[3], prompt[1024:1152])
    # a salted root (LoRA, cache salt) gives other keys, as it does for chunks
    assert state_key(prompt, n, CHUNK, salted_root("lora-a")) != state_key(prompt, n, CHUNK)
    assert state_key(prompt[:100], 100, CHUNK) == state_key_after(ROOT_KEY, prompt[:100], 100)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: state_key(p, 0, CHUNK), "num_tokens must be in"),
        (lambda p: state_key(p, 101, CHUNK), "num_tokens must be in"),
        (lambda p: state_key(p, 50, 0), "chunk_size must be positive"),
        (lambda p: state_key_after(b"short", [], 3), "previous key must be 32 bytes"),
        (lambda p: state_key_after(ROOT_KEY, p[:5], 4), "trailing tokens"),
        (lambda p: state_key(p[:9] + [-1] + p[10:], 20, CHUNK), "not an unsigned 32-bit integer"),
        (lambda p: state_slot(1153, 1152), "whole blocks of 1152"),
        (lambda p: state_slot(0, 1152), "whole blocks of 1152"),
    ],
)
def test_bad_input_is_a_clear_error(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(tokens(100, seed=4))  # type: ignore[operator]


def test_align_mode_slots_and_step_ends() -> None:
    """Slot p holds the state after (p + 1) blocks; a step leaves a reusable state only
    when it ends on a block boundary (vLLM's scheduler splits prefill there)."""
    assert [state_slot(n, 1152) for n in (1152, 2304, 4608)] == [0, 1, 3]
    assert state_after_step(0, 1152, 1152) == 1152
    assert state_after_step(1152, 1152, 1152) == 2304
    assert state_after_step(2304, 700, 1152) is None  # the prompt's last, unaligned chunk
    assert state_after_step(3003, 1, 1152) is None  # a decode step inside a block
    assert state_after_step(3455, 1, 1152) == 3456  # a decode step that completes a block
    assert state_after_step(1152, 0, 1152) is None


REAL_VLLM = pytest.mark.timeout(1800)
"""The real-vLLM tests' time limit, as in the other real-vLLM modules: the unit tests' 120 s
default is too short for vLLM's prefix-cache probe on a busy 2-core machine."""


@REAL_VLLM
def test_gdn_state_round_trip_through_the_daemon_with_vllms_spec(
    daemon: Daemon,
    forkserver: Forkserver,
    tmp_path: Path,
) -> None:
    """vLLM's own MambaSpec for the tiny Qwen3-Next (3 GDN groups + 1 full-attention
    group, padded pages as the real engine lays them out): the state after 2 blocks goes
    from engine A's blocks to engine B's other blocks byte for byte, B's other bytes
    untouched, only at that exact length, only in the state namespace."""
    spec = {"address": daemon.address, "block_size": 1152, "chunk_size": CHUNK}
    out = run_harness(forkserver, "mamba_state", spec, tmp_path, "gdn")
    # conv (3, 1024) bf16 + SSM (4, 128, 128) fp32 per layer, three layers; pages are padded
    assert out["state_bytes"] == out["payload_bytes"] == 3 * (3 * 1024 * 2 + 4 * 128 * 128 * 4) == 804864
    assert out["real_page_bytes"] == 268288 and out["page_bytes"] == 294912
    assert out["put"] == [0] and out["hit"] == 1
    assert out["other_hits"] == {str(m): 0 for m in (1152, 2303, 2305, 3456)}
    assert out["in_kv_namespace"] == [False]
    assert out["wrong_bytes"] == 0
    assert out["nonzero_bytes_in_b"] > 0.9 * out["state_bytes"]  # random bytes, a few are zero
    assert out["nonzero_bytes_in_b"] <= out["state_bytes"]
    assert out["tag"] == "state-gdn_attn-L3-3x1024:bfloat16,4x128x128:float32"
    assert out["namespace"] == out["kv_namespace"] + "|layout=" + out["tag"]
    assert out["tp2_namespace"].endswith("|tp1of2|c256|layout=state-gdn_attn-L3-3x512:bfloat16,2x128x128:float32")
    refusals = out["refusals"]
    assert refusals["mode_none"].startswith("UnsupportedState: KV cache group 0") and "'none'" in refusals["mode_none"]
    assert "state tensor (16, 4, 128, 128) torch.float32" in refusals["wrong_shape"]
    assert refusals["missing_layer"] == "UnsupportedState: Mamba layer model.layers.2.linear_attn has no KV cache"
    assert "null block" in refusals["null_block"]
    assert refusals["short_payload"] == "ValueError: a state is 804864 bytes, got 804863"


@REAL_VLLM
def test_real_vllm_keeps_gdn_states_of_exactly_their_prefix(
    forkserver: Forkserver, checkpoints: Callable[..., dict[str, Path]], tmp_path: Path
) -> None:
    """The tiny Qwen3-Next in real vLLM (prefix caching on, so 'align' mode), no
    connector: the layout reads vLLM's own KV cache config and caches, and the states
    vLLM's prefix cache keeps are what the key promises: the state after ``n`` tokens
    is byte-identical whenever the first ``n`` tokens are (recomputed after a prefix
    cache reset, other tokens after ``n``, in one prefill step or two), differs when a
    token before ``n`` does, and exists only where a step ended on a block boundary."""
    model = checkpoints("qwen3_next")["qwen3_next"]
    out = run_harness(forkserver, "mamba_probe", {"model": str(model)}, tmp_path, "probe")
    assert out["block_size"] == 1152  # vLLM raised the attention block to hold a GDN page
    assert out["groups"] == [0, 1, 2] and len(out["layers"]) == 3
    assert out["state_bytes"] == 804864
    assert out["tag"] == "state-gdn_attn-L3-3x1024:bfloat16,4x128x128:float32"
    runs = {name: (run["cached_tokens"], run["states"]) for name, run in out["runs"].items()}
    one, two = runs["p_two_blocks"][1]["1152"], runs["p_two_blocks"][1]["2304"]
    assert one != two
    assert runs["p_one_block"] == (0, {"1152": one})
    assert runs["p_two_blocks"][0] == 1152  # vLLM's own hit: one block, its state reused
    assert runs["fresh_one_block"] == (0, {"1152": one})  # recomputed: the same bytes
    assert runs["fresh_two_blocks"] == (1152, {"1152": one, "2304": two})
    # one prefill step of two blocks: vLLM keeps the state after two, none after one
    changed_late = runs["changed_before_two_blocks"]
    assert changed_late[0] == 0 and set(changed_late[1]) == {"2304"} and changed_late[1]["2304"] != two
    # computed in one prefill step of two blocks, the state after two is the same bytes
    # as from the state after one plus a second step: how a replica splits its prefill
    # does not change what it stores
    assert runs["p_two_blocks_one_step"] == (0, {"2304": two})
    changed_early = runs["changed_before_one_block"]
    assert changed_early[0] == 0 and set(changed_early[1]) == {"1152"} and changed_early[1]["1152"] != one
