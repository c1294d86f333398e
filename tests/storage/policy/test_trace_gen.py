"""The generated traces (benchmarks/trace_gen.py), the baselines and the multi-trace table."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_server.storage.base import ChunkKey

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"
sys.path.insert(0, str(BENCH))

from policy_sim import BLOCK_TOKENS, load_trace, simulate  # noqa: E402
from policy_table import TRACES, format_rows, table  # noqa: E402
from sim_policies import ARCPolicy, S3FIFOPolicy  # noqa: E402
from trace_gen import SHAPES, dumps, generate  # noqa: E402

COMMITTED = {
    "zipf-prompts": (1, BENCH / "traces" / "zipf_prompts.jsonl"),
    "agentic": (2, BENCH / "traces" / "agentic.jsonl"),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_same_seed_same_bytes_other_seed_other_bytes(shape: str) -> None:
    a, b = dumps(generate(shape, 5, 300)), dumps(generate(shape, 5, 300))
    assert a == b and hashlib.sha256(a).digest() == hashlib.sha256(b).digest()
    assert dumps(generate(shape, 6, 300)) != a


@pytest.mark.parametrize("shape", sorted(COMMITTED))
def test_the_committed_trace_is_its_generators_output(shape: str) -> None:
    seed, path = COMMITTED[shape]
    assert path.stat().st_size < 2 * 1024 * 1024
    assert hashlib.sha256(dumps(generate(shape, seed))).hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("shape", sorted(COMMITTED))
def test_the_traces_are_well_formed_prefix_chains(shape: str) -> None:
    """Block count matches the length; a block id names one prefix (never two different parents)."""
    requests = load_trace(COMMITTED[shape][1])
    parent: dict[int, int | None] = {}
    for r in requests:
        assert len(r.hash_ids) == -(-r.input_length // BLOCK_TOKENS)
        for i, b in enumerate(r.hash_ids):
            before = r.hash_ids[i - 1] if i else None
            assert parent.setdefault(b, before) == before
    times = [r.timestamp_ms for r in requests]
    assert times == sorted(times)


def test_the_cli_writes_the_same_bytes(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    cmd = [
        sys.executable,
        str(BENCH / "trace_gen.py"),
        "agentic",
        "--seed",
        "3",
        "--requests",
        "200",
        "--out",
        str(out),
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    assert out.read_bytes() == dumps(generate("agentic", 3, 200))
    bad = subprocess.run([*cmd[:3], "--requests", "0", "--out", str(out)], capture_output=True, text=True)
    assert bad.returncode != 0 and "--requests must be at least 1" in bad.stderr


def _key(i: int) -> ChunkKey:
    return ChunkKey("ns", i.to_bytes(32, "big"))


def test_arc_keeps_a_reused_key_through_a_scan() -> None:
    p = ARCPolicy(4)
    held: list[ChunkKey] = []

    def access(k: ChunkKey) -> None:
        if k in held:
            p.touched(k)
            return
        p.admit(k, 1, None)
        if len(held) >= 4:
            v = p.victim(lambda _: False)
            assert v is not None
            held.remove(v)
            p.removed(v)
        held.append(k)
        p.inserted(k, 1, None)

    for k in (_key(1), _key(1), *(_key(i) for i in range(10, 30))):
        access(k)
    assert _key(1) in held  # in T2: a scan of one-offs goes through T1
    assert ARCPolicy(4).victim(lambda _: False) is None


def test_s3fifo_promotes_what_was_read_and_ghosts_the_rest() -> None:
    p = S3FIFOPolicy(10)  # small queue: 1 chunk
    for i in range(3):
        p.inserted(_key(i), 1, None)
    p.touched(_key(0))
    v = p.victim(lambda _: False)  # key 0 was read in the small queue: it moves to main
    assert v == _key(1)
    p.removed(v)
    assert _key(0) in p.main and _key(1) in p.ghost
    p.inserted(_key(1), 1, None)  # back from the ghost: straight to main
    assert _key(1) in p.main


def test_baselines_on_a_trace_cut_are_between_nothing_and_belady() -> None:
    requests = load_trace(TRACES["agentic"], 400)
    for cap in (50, 200):
        best = simulate(requests, cap, "belady").token_hit_rate
        for name in ("arc", "s3fifo"):
            assert 0.0 < simulate(requests, cap, name).token_hit_rate <= best


def test_the_multi_trace_table_on_a_cut() -> None:
    rows = table(["zipf-prompts", "agentic"], [5, 20], limit=300, processes=1, progress=lambda s: None)
    assert [(r["trace"], r["capacity_pct"]) for r in rows] == [
        ("zipf-prompts", 5),
        ("zipf-prompts", 20),
        ("agentic", 5),
        ("agentic", 20),
    ]
    for r in rows:
        assert r["base"] == max(r["rates"][p] for p in ("lru", "arc", "s3fifo")) > 0
        assert r["ratios"][r["base_policy"]] == 1.0
        assert r["rates"]["belady"] >= r["base"]
        assert r["goal_met"] == (r["rates"]["adaptive"] >= r["base"])
    text = format_rows(rows, markdown=True)
    assert text.count("\n") == 1 + len(rows) and "| agentic | 20% (" in text
    with pytest.raises(ValueError, match="baseline needs"):
        table(["agentic"], [5], policies=["lru", "adaptive"], limit=50, progress=lambda s: None)
    with pytest.raises(FileNotFoundError, match="not a file"):
        table(["no-such-trace"], [5], limit=50, progress=lambda s: None)
