"""The Mamba / GDN wiring's rules (integrations/vllm/states.py), without vLLM: which groups
the chunks see, which hand-offs become state saves, and which prefix a hit may end at."""

from __future__ import annotations

import types

import pytest

from lmcache_client import chunk_keys
from lmcache_client.integrations.vllm.mamba import StateGroup, StateLayout, state_key
from lmcache_client.integrations.vllm.states import StateWiring
from lmcache_client.integrations.vllm.worker.statemover import StateMover

BLOCK, CHUNK = 1152, 256


def _wiring() -> StateWiring:
    """Qwen3-Next's order: three GDN groups (0, 1, 2), then the full-attention group (3)."""
    groups = tuple(StateGroup(g, (f"model.layers.{g}.linear_attn",), ((3, 8),), ("float32",)) for g in range(3))
    layout = StateLayout(groups, BLOCK, "gdn_attn")
    config = types.SimpleNamespace(
        kv_cache_groups=[
            types.SimpleNamespace(layer_names=[f"model.layers.{g}.x"], kv_cache_spec=None) for g in range(4)
        ]
    )
    return StateWiring(layout, config, CHUNK)


def test_the_chunks_see_the_attention_groups_only() -> None:
    w = _wiring()
    assert w.attention_ids == [3] and w.state_ids == [0, 1, 2] and w.step == 2304
    assert w.attention_layers == {"model.layers.3.x"}
    blocks = ([0, 7], [0, 8], [0, 9], [1, 2, 3])
    assert w.attention_blocks(blocks) == ([1, 2, 3],)
    assert w.state_blocks(blocks, 2304) == [7, 8, 9]  # slot 1: the state after two blocks
    assert w.state_blocks(blocks, 1152) is None  # slot 0 is the null block: no state there
    assert w.state_blocks(blocks, 3456) is None  # no slot 2
    with pytest.raises(ValueError, match="whole blocks"):
        w.state_blocks(blocks, 2300)


def test_only_hand_offs_at_a_chunk_end_of_every_group_are_saved() -> None:
    w = _wiring()
    prompt = list(range(5000))
    keys = chunk_keys(prompt, CHUNK)
    offloads = [(g, 10 + g, 1152) for g in range(3)]  # 1152 ends no chunk of 256
    offloads += [(g, 20 + g, 2304) for g in range(3)]
    offloads += [(0, 30, 3456), (1, 31, 3456)]  # one group missing: not saved
    [save] = w.saves("r", offloads, keys)
    assert (save.req_id, save.tokens, save.blocks) == ("r", 2304, [20, 21, 22])
    assert save.key == state_key(prompt, 2304, CHUNK)  # the module's key of exactly 2304 tokens
    assert w.saves("r", [(g, 0, 2304) for g in range(3)], keys) == []  # the null block holds nothing
    assert w.saves("r", [(g, 5, 2304) for g in range(3)], keys[:8]) == []  # chunks not known that far


def test_a_hit_is_the_longest_stored_state_below_the_prompt() -> None:
    w = _wiring()
    prompt = list(range(7000))
    keys = chunk_keys(prompt, CHUNK)
    asked: list[int] = []
    have = {state_key(prompt, 2304, CHUNK)}

    def stored(key: bytes) -> bool:
        asked.append(next(n for n in (2304, 4608, 6912) if state_key(prompt, n, CHUNK) == key))
        return key in have

    assert w.hit(keys, len(keys), len(prompt), stored) == 2304
    assert asked == [6912, 4608, 2304]  # longest first
    assert w.hit(keys, 17, len(prompt), stored) == 2304  # 17 chunks: 4352 tokens, below 4608
    assert w.hit(keys, 8, len(prompt), stored) == 0  # chunks end before any state
    assert w.hit(keys, len(keys), 2304, stored) == 0  # the last prompt token is always computed
    assert w.hit(keys, len(keys), 2305, stored) == 2304
    have.clear()
    assert w.hit(keys, len(keys), len(prompt), stored) == 0  # chunks without their state: a miss


def test_the_scheduler_saves_handed_off_states_and_loads_a_state_only_at_its_length() -> None:
    """The scheduler (stand-in outputs): chunk saves carry the attention group's blocks only;
    vLLM's hand-off at 2304 tokens becomes a state save; a load vLLM cut short of the
    state's length carries no state key, and the worker fails it rather than load chunks
    without their state."""
    from lmcache_client.integrations.vllm.meta import LoadRequest
    from lmcache_client.integrations.vllm.scheduler import SchedulerSide
    from lmcache_client.integrations.vllm.scheduler.perrequest import Hit
    from lmcache_client.integrations.vllm.worker import LoadResult, WorkerStats
    from lmcache_client.integrations.vllm.worker.loads import Loads
    from lmcache_client.keys import ROOT_KEY

    from .vllm_harness.engine import NewRequestData, SchedulerOutput
    from .vllm_harness.fixtures import tokens

    side = SchedulerSide([], CHUNK, async_load=True, states=_wiring())
    prompt = tokens(2500, 7)
    blocks = ([0, 11, 12], [0, 21, 22], [0, 31, 32], [40, 41, 42])
    out = SchedulerOutput([NewRequestData("r", prompt, blocks, 0)], num_scheduled_tokens={"r": 2304})
    out.kv_connector_block_state = types.SimpleNamespace(  # type: ignore[attr-defined]
        boundary_state_offloads={"r": [(0, 11, 2304), (1, 21, 2304), (2, 31, 2304)], "gone": [(0, 5, 2304)]}
    )
    meta = side.build_meta(out)
    [save] = meta.saves
    assert save.block_ids == [40, 41, 42] and save.group_block_ids is None and len(save.keys) == 9
    [state] = meta.state_saves
    assert (state.tokens, state.blocks, state.key) == (2304, [11, 21, 31], state_key(prompt, 2304, CHUNK))

    def alloc(req_id: str, external: int) -> LoadRequest:
        side.per_request.hits[req_id] = Hit(0, 9, [], state_tokens=2304)
        side.per_request.roots[req_id] = ROOT_KEY
        request = types.SimpleNamespace(request_id=req_id, prompt_token_ids=prompt)
        side.after_alloc(request, types.SimpleNamespace(get_block_ids=lambda: blocks), external)
        [load] = [x for x in side._async_loads if x.req_id == req_id]
        return load

    good = alloc("b", 2304)
    assert (good.state_tokens, good.state_blocks, good.end_token) == (2304, [11, 21, 31], 2304)
    assert good.state_key == state_key(prompt, 2304, CHUNK) and good.block_ids == [40, 41, 42]
    cut = alloc("c", 1152)  # vLLM loads fewer tokens than the state's length
    assert (cut.state_tokens, cut.state_key, cut.state_blocks) == (1152, None, None)

    mover = StateMover(types.SimpleNamespace(layout=side.states.layout), "ns")  # type: ignore[arg-type]
    loads = Loads(None, None, WorkerStats(), mover, per_request=True)  # type: ignore[arg-type]
    assert not loads._load_state(cut, None, 1152, LoadResult(0))  # type: ignore[arg-type]
    assert not loads._load_state(good, None, 2048, LoadResult(0))  # type: ignore[arg-type]  # a chunk missing


@pytest.mark.parametrize("ranks_agree", [True, False], ids=["agree", "disagree"])
def test_asynchronous_lookups_find_the_state_on_the_lanes_not_in_the_step(address: str, ranks_agree: bool) -> None:
    """With asynchronous lookups each TP rank's lane also walks the rank's stored states
    after its chunk lookup, so vLLM's scheduler thread asks the daemon nothing; where the
    ranks' answers differ, the scheduler checks them together (counted) and the hit ends
    at a state every rank holds."""
    import threading
    import time

    from lmcache_client import CacheClient
    from lmcache_client.integrations.transfer import ChunkTransfer
    from lmcache_client.integrations.vllm.lanes import Lane
    from lmcache_client.integrations.vllm.scheduler import LookupService, SchedulerSide

    from .vllm_harness.engine import Request
    from .vllm_harness.fixtures import tokens

    prompt = tokens(5000, 9)  # 19 full chunks: states could end at 2304 or 4608 tokens
    keys = chunk_keys(prompt, CHUNK)[:19]
    chunk_ns = [f"state-lanes-{ranks_agree}-tp{r}of2" for r in range(2)]
    state_ns = [f"{ns}-states" for ns in chunk_ns]
    clients = [CacheClient(address, fail_open=False) for _ in range(3)]
    try:
        for r in range(2):
            clients[0].put(keys, [b"c" * 64] * len(keys), namespace=chunk_ns[r])
            held = (2304, 4608) if ranks_agree or r == 0 else (2304,)
            clients[0].put([state_key(prompt, n, CHUNK) for n in held], [b"s" * 64] * len(held), namespace=state_ns[r])
        lanes = [Lane(f"lookup-{r}", ChunkTransfer(clients[r + 1], chunk_ns[r], 64)) for r in range(2)]
        side = SchedulerSide(
            [ChunkTransfer(clients[0], ns, 64) for ns in chunk_ns],
            CHUNK,
            lookups=LookupService(lanes),
            async_load=True,
            states=_wiring(),
            state_transfers=[ChunkTransfer(clients[0], ns, 64, codec="none") for ns in state_ns],
        )
        on_scheduler: list[str] = []
        scheduler_thread = threading.get_ident()
        for t in side.state_transfers:
            original = t.lookup

            def counted(ks, original=original, **kw):  # type: ignore[no-untyped-def]
                if threading.get_ident() == scheduler_thread:
                    on_scheduler.append("lookup")
                return original(ks, **kw)

            t.lookup = counted  # type: ignore[method-assign]
        request = Request("r", prompt)
        deadline = time.monotonic() + 30
        while (n := side.num_new_matched_tokens(request, 0)) is None:
            assert time.monotonic() < deadline, "the lookup was never answered"
            time.sleep(0.002)
        if ranks_agree:
            assert n == 4608 and side.stats["state_lookups_in_step"] == 0 and on_scheduler == []
        else:  # rank 1 holds no state at 4608: the hit ends at 2304, checked in the step
            assert n == 2304 and side.stats["state_lookups_in_step"] == 1 and on_scheduler
        side.lookups.close()  # type: ignore[union-attr]
    finally:
        for c in clients:
            c.close()


def test_asynchronous_state_saves_copy_in_the_step_and_store_on_the_save_lane() -> None:
    """``wait_for_save`` copies each Mamba state out of its blocks at once (vLLM may hand
    them out from the next step on) and stores it on the save lane; the count arrives with
    ``get_finished``, and a save lane past ``max_queued_saves`` drops the states (counted)."""
    import threading

    from lmcache_client.integrations.vllm.lanes import Lane
    from lmcache_client.integrations.vllm.states import StateSave
    from lmcache_client.integrations.vllm.worker.transferengine import TransferEngine
    from lmcache_client.integrations.vllm.worker.workerstats import WorkerStats

    caller, gate = threading.get_ident(), threading.Event()
    seen: dict[str, int] = {}

    class Mover:
        def gather(self, saves: list[StateSave]) -> list[tuple[StateSave, bytearray]]:
            seen["gather"] = threading.get_ident()
            return [(s, bytearray(b"state")) for s in saves]

        def store(self, gathered: list[tuple[StateSave, bytearray]], transfer: object) -> int:
            seen["store"] = threading.get_ident()
            gate.wait(10)
            return len(gathered)

    worker = types.SimpleNamespace(state_mover=Mover(), stores=True, asleep=False, stats=WorkerStats(), engine=None)
    lanes = Lane("load", None), Lane("save", None)
    engine = TransferEngine(worker, *lanes, max_queued_saves=1)  # type: ignore[arg-type]
    saves = [StateSave("r", b"k" * 32, 2304, [1, 2, 3]), StateSave("s", b"j" * 32, 2304, [4, 5, 6])]
    engine.save_states(saves)
    assert seen["gather"] == caller, "copied on vLLM's thread, in the step"
    assert engine.in_flight == (0, 1) and worker.stats.stored_states == 0
    engine.save_states(saves[:1])  # the lane holds one job already: dropped
    assert worker.stats.saves_dropped == 1
    gate.set()
    lanes[1].drain(10)
    assert seen["store"] != caller, "stored on the save lane"
    engine.finished()
    assert engine.in_flight == (0, 0) and worker.stats.stored_states == 2
    engine.close()
