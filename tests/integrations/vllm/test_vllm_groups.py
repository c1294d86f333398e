"""Several KV cache groups (integrations/vllm/groups.py), without a running vLLM.

What groups are refused (against vLLM's own spec classes, in vLLM's venv), the
sliding-window arithmetic of what may be stored, and the copies: a
sliding-window group's null blocks are never written or read, each group
takes its own layers' rows of the payload.  test_vllm_hybrid.py runs the
same code inside vLLM.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lmcache_client.integrations.blocklayout import probe_block_layout  # noqa: E402
from lmcache_client.integrations.paged import PagedCopier  # noqa: E402
from lmcache_client.integrations.vllm.connector import LMCacheServerConnectorV1  # noqa: E402
from lmcache_client.integrations.vllm.groups import (  # noqa: E402
    FULL,
    NULL_BLOCK,
    SLIDING,
    GroupCopier,
    GroupInfo,
    UnsupportedGroups,
    group_slots,
    savable,
)

from .vllm_harness.engine import Role, vllm_config  # noqa: E402
from .vllm_harness.fixtures import Forkserver, run_harness  # noqa: E402
from .vllm_harness.standins import cpu_write  # noqa: E402

BLOCK, HEADS, DIM, BLOCKS = 4, 2, 8, 6


def test_vllms_own_spec_classes_read_or_refused_in_one_message(forkserver: Forkserver, tmp_path: Path) -> None:
    out = run_harness(forkserver, "group_specs", {}, tmp_path, "specs")
    assert out["full"] == [["full", 128, 0, ["model.layers.0.self_attn.attn"]]]
    assert out["full+sliding"] == [
        ["sliding", 128, 128, ["model.layers.0.self_attn.attn"]],
        ["full", 128, 0, ["model.layers.1.self_attn.attn"]],
    ]
    # the manager off: vLLM turns sliding-window layers into full attention that keeps every token
    assert out["unified"] == [["full", 128, 0, ["model.layers.0.self_attn.attn"]]]
    for case, kinds in (
        ("mamba", ["MambaSpec"]),
        ("chunked_local", ["ChunkedLocalAttentionSpec"]),
        ("cross+swa_mla", ["CrossAttentionSpec", "SlidingWindowMLASpec"]),
    ):
        message = out[case]
        assert message.startswith("UnsupportedGroups: lmcache-server connector cannot serve"), message
        assert message.count("UnsupportedGroups") == 1
        for kind in kinds:
            assert f"({kind}, 1 layers" in message
        assert "FullAttentionSpec" not in message.split("(it serves")[0]


def test_an_unknown_group_kind_stops_the_connector_at_start(address: str) -> None:
    """A fabricated spec kind (a compressed cache, say) next to a full-attention group: the
    constructor, in either role, raises one error naming it; nothing is registered."""

    class CompressedIndexerSpec:
        block_size = 16

    full = type("FullAttentionSpec", (), {"block_size": 16, "num_kv_heads": 2, "head_size": 8})
    groups = [
        SimpleNamespace(kv_cache_spec=full(), layer_names=["model.layers.0.self_attn.attn"]),
        SimpleNamespace(kv_cache_spec=CompressedIndexerSpec(), layer_names=["model.layers.1.indexer"]),
    ]
    for role in (Role.SCHEDULER, Role.WORKER):
        with pytest.raises(UnsupportedGroups) as info:
            LMCacheServerConnectorV1(
                vllm_config(address, torch.bfloat16, 16), role, kv_cache_config=SimpleNamespace(kv_cache_groups=groups)
            )
        assert "group 1 (CompressedIndexerSpec, 1 layers, e.g. model.layers.1.indexer)" in str(info.value)
        assert "group 0" not in str(info.value)


def test_several_groups_need_asynchronous_loads(address: str) -> None:
    sliding = type("SlidingWindowSpec", (), {"block_size": 16, "sliding_window": 32})
    full = type("FullAttentionSpec", (), {"block_size": 16})
    groups = [
        SimpleNamespace(kv_cache_spec=sliding(), layer_names=["model.layers.0.self_attn.attn"]),
        SimpleNamespace(kv_cache_spec=full(), layer_names=["model.layers.1.self_attn.attn"]),
    ]
    config = vllm_config(address, torch.bfloat16, 16, async_transfers=False)
    with pytest.raises(ValueError, match="2 KV cache groups .sliding, full.*async_transfers"):
        LMCacheServerConnectorV1(config, Role.SCHEDULER, kv_cache_config=SimpleNamespace(kv_cache_groups=groups))


def test_what_a_sliding_window_still_holds() -> None:
    """vLLM nulls whole blocks below ``computed - window + 1`` when it schedules a step: a
    chunk starting there can no longer be stored."""
    groups = [GroupInfo(SLIDING, 128, ("a",), sliding_window=128), GroupInfo(FULL, 128, ("b",))]
    assert groups[0].skipped_tokens(127) == 0 and groups[0].skipped_tokens(700) == 573
    assert savable(groups, 0, 0)  # a prompt computed in one step: every block is real
    assert savable(groups, 512, 640)  # 640 computed: blocks from 512 on are kept
    assert not savable(groups, 384, 640)  # the block of tokens 384..511 is gone
    assert savable([GroupInfo(FULL, 128, ("b",))], 0, 10_000)  # full attention keeps everything
    wide = [GroupInfo(SLIDING, 16, ("a",), sliding_window=64, extra_retained_tokens=16)]
    assert wide[0].skipped_tokens(100) == 100 - 64 + 1 - 16
    assert savable(wide, 16, 100) and not savable(wide, 0, 100)


def _caches(n_layers: int) -> list[object]:
    return [torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM) for _ in range(n_layers)]


def _copier(layers: list[object]) -> PagedCopier:
    def write(key: object, value: object, cache: object, slots: object) -> None:
        cpu_write(key, value, cache, slots)

    block = probe_block_layout(
        write,
        block_tokens=BLOCK,
        num_heads=HEADS,
        head_dim=DIM,
        content=2 * DIM,
        strides=layers[0].stride()[1:],  # type: ignore[attr-defined]
        dtype=torch.float32,
        input_dtype=torch.float32,
        device=torch.device("cpu"),
    )
    return PagedCopier(layers, block, threads=1)


def test_a_sliding_window_groups_null_blocks_are_never_touched() -> None:
    """Model layers 0 and 2 are a sliding-window group, 1 and 3 full attention (Gemma-2's
    alternation).  A load of tokens 0..11 whose first two sliding-window blocks are null
    writes every token of the full group, only tokens 8..11 of the sliding group, and
    never block 0 (the null block) of either; a save of a range with null blocks is refused."""
    swa, full = _caches(2), _caches(2)
    groups = [
        GroupCopier(GroupInfo(SLIDING, BLOCK, ("l0", "l2"), sliding_window=5), [0, 2], _copier(swa)),
        GroupCopier(GroupInfo(FULL, BLOCK, ("l1", "l3")), [1, 3], _copier(full)),
    ]
    payload = torch.randn(4, 2, 12, HEADS, DIM)
    slots = group_slots(groups, [[NULL_BLOCK, NULL_BLOCK, 5], [2, 3, 4]], 0, 12, BLOCK, BLOCK)
    assert not slots.complete()
    slots.scatter(payload)
    for cache in swa + full:
        assert not cache[NULL_BLOCK].any(), "the null block was written"
    for cache in swa:
        assert not cache[1:5].any()  # blocks the sliding group does not hold here
    back = torch.zeros(4, 2, 12, HEADS, DIM)
    with pytest.raises(ValueError, match="null blocks"):
        slots.gather(back)
    whole = group_slots(groups, [[NULL_BLOCK, NULL_BLOCK, 5], [2, 3, 4]], 8, 12, BLOCK, BLOCK)
    assert whole.complete()
    whole.gather(back[:, :, 8:12])
    assert torch.equal(back[:, :, 8:12], payload[:, :, 8:12]), "each group's layers went to their own rows"
    full_only = torch.zeros(4, 2, 12, HEADS, DIM)
    groups[1].gather(group_slots(groups, [[5, 5, 5], [2, 3, 4]], 0, 12, BLOCK, BLOCK).parts[1][1], full_only)
    assert torch.equal(full_only[[1, 3]], payload[[1, 3]]) and not full_only[[0, 2]].any()


@pytest.mark.parametrize("batched", [False, True], ids=["one-by-one", "batched"])
def test_the_workers_chunk_copies_over_several_groups(batched: bool) -> None:
    """The worker's one copy mechanism (worker/chunkcopies.py) over Gemma-2's alternation:
    a load of three chunks and a save of the last one write and read exactly the tokens of
    the groups' own copies (null blocks untouched, each group its own rows); batched, each
    group's chunks wait for the flush and go in one copier call per group."""
    from lmcache_client.integrations.batched import BatchedCopies
    from lmcache_client.integrations.vllm.worker.chunkcopies import ChunkCopies

    torch.manual_seed(7)
    payload = torch.randn(4, 2, 12, HEADS, DIM)
    tables = [[NULL_BLOCK, NULL_BLOCK, 5], [2, 3, 4]]

    def groups_over(swa: list[Any], full: list[Any]) -> list[GroupCopier]:
        return [
            GroupCopier(GroupInfo(SLIDING, BLOCK, ("l0", "l2"), sliding_window=5), [0, 2], _copier(swa)),
            GroupCopier(GroupInfo(FULL, BLOCK, ("l1", "l3")), [1, 3], _copier(full)),
        ]

    want_swa, want_full = _caches(2), _caches(2)
    group_slots(groups_over(want_swa, want_full), tables, 0, 12, BLOCK, BLOCK).scatter(payload)
    swa, full = _caches(2), _caches(2)
    groups = groups_over(swa, full)
    batches = [BatchedCopies(g.copier) for g in groups] if batched else None
    load = ChunkCopies(group_slots(groups, tables, 0, 12, BLOCK, BLOCK), batches)
    for i in range(3):
        load.scatter(slice(4 * i, 4 * i + 4), payload[:, :, 4 * i : 4 * i + 4])
    assert load.batched == batched and any(c.any() for c in swa + full) != batched, "batched: copied at flush"
    load.flush()
    assert all(torch.equal(a, b) for a, b in zip(swa + full, want_swa + want_full))
    back = torch.zeros(4, 2, 4, HEADS, DIM)
    save = ChunkCopies(group_slots(groups, tables, 8, 12, BLOCK, BLOCK), batches)
    save.gather(slice(0, 4), back)
    save.flush()
    assert torch.equal(back, payload[:, :, 8:12]), "every group's layers back in their own rows"
    if batches is not None:
        assert [b.launches for b in batches] == [2, 2], "one scatter and one gather per group"


def test_group_slots_refuse_a_block_table_per_group_mismatch() -> None:
    groups = [GroupCopier(GroupInfo(FULL, BLOCK, ("l0",)), [0], _copier(_caches(1)))]
    with pytest.raises(ValueError, match="2 block lists for 1 KV cache groups"):
        group_slots(groups, [[1], [2]], 0, 4, BLOCK, BLOCK)


def test_the_scheduler_sends_every_groups_blocks_and_stops_saving_past_the_window() -> None:
    """A request prefilled in two steps of 640 tokens with chunks of 384 and a 128-token
    window: the first step's save carries both groups' blocks; chunk 1 is completed by
    the second step, after vLLM freed the window's blocks below token 512, so it and every
    later chunk are not saved (``saves_out_of_window``); blocks appended later extend each
    group's list."""
    from lmcache_client.integrations.vllm.scheduler import SchedulerSide

    from .vllm_harness.engine import CachedRequestData, NewRequestData, SchedulerOutput
    from .vllm_harness.fixtures import tokens

    side = SchedulerSide(
        [], 384, groups=[GroupInfo(SLIDING, 128, ("l0",), sliding_window=128), GroupInfo(FULL, 128, ("l1",))]
    )
    prompt = tokens(1300, 5)
    swa, full = list(range(10, 15)), list(range(20, 25))
    first = side.build_meta(
        SchedulerOutput([NewRequestData("r", prompt, (swa, full), 0)], num_scheduled_tokens={"r": 640})
    )
    [save] = first.saves
    assert (save.first_chunk, len(save.keys)) == (0, 1)
    assert save.group_block_ids == [swa, full] and save.block_ids == swa
    cached = CachedRequestData(["r"], set(), [([15, 16, 17, 18, 19], [25, 26, 27, 28, 29])], [640])
    second = side.build_meta(SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={"r": 640}))
    assert second.saves == [] and side.stats["saves_out_of_window"] == 1
    assert side.per_request.trackers["r"].group_ids == [swa + [15, 16, 17, 18, 19], full + [25, 26, 27, 28, 29]]
    cached = CachedRequestData(["r"], set(), [([30], [31])], [1280])
    assert side.build_meta(SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={"r": 20})).saves == []
    assert side.stats["saves_out_of_window"] == 1  # counted once per request
