"""The offline bounds of benchmarks/eviction_bounds.py: their measures and models are right."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

from eviction_bounds import (  # noqa: E402
    _auc,
    _corr,
    admission_rate,
    auc_of_sigma,
    predicted_belady,
    request_features,
)
from policy_sim import simulate, synthetic_requests, trace_keys  # noqa: E402


def test_auc_counts_pairs_and_ties() -> None:
    rng = random.Random(3)
    scores = [rng.choice([0.1, 0.2, 0.3, 0.5, 0.9]) for _ in range(300)]
    labels = [rng.random() < s for s in scores]
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    pairs = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    assert math.isclose(_auc(scores, labels), pairs / (len(pos) * len(neg)))
    assert math.isclose(_corr([1, 2, 3, 4], [2, 4, 6, 8]), 1.0)


def test_noise_gives_the_stated_auc() -> None:
    rng = random.Random(5)
    for sigma in (0.5, 1.2):
        labels = [rng.random() < 0.4 for _ in range(4000)]
        scores = [float(y) + rng.gauss(0, sigma) for y in labels]
        assert abs(_auc(scores, labels) - auc_of_sigma(sigma)) < 0.02


def test_perfect_predictor_is_the_reuse_oracle_and_noise_costs_hits() -> None:
    requests = synthetic_requests(1500)
    keys = trace_keys(requests)
    capacity = 400
    perfect = admission_rate(requests, keys, "lru", capacity, 0.0, 0.5)
    assert perfect == simulate(requests, capacity, "oracle-reuse-lru", keys).token_hit_rate
    assert admission_rate(requests, keys, "lru", capacity, 2.0, 0.5) < perfect
    lfuda = simulate(requests, capacity, "lfuda", keys).token_hit_rate
    assert admission_rate(requests, keys, "lfuda", capacity, 0.0, 0.5) > lfuda


def test_predicted_belady_degrades_with_noise() -> None:
    requests = synthetic_requests(1500)
    capacity = 400
    exact = predicted_belady(requests, capacity, 0.0)
    assert exact >= simulate(requests, capacity, "belady").token_hit_rate - 0.01
    assert predicted_belady(requests, capacity, 3.0) < exact - 0.02


def test_request_features(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 2000, "output_length": 90, "hash_ids": [0, 1, 2, 3]},
        {"timestamp": 1000, "input_length": 1500, "output_length": 10, "hash_ids": [0, 7, 8]},
        {"timestamp": 12000, "input_length": 2600, "output_length": 300, "hash_ids": [0, 1, 2, 4, 5, 6]},
        {"timestamp": 13000, "input_length": 700, "output_length": 5, "hash_ids": [0, 9]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, other, second = request_features(path)  # the two-block request is left out
    assert (first["turn"], first["new_blocks"], first["seconds_since_turn"]) == (
        0,
        4,
        -1,
    )  # the very first request: block 0 is new too
    assert first["continued"] and math.isclose(first["log_gap"], math.log(2))  # block 2, read 2 requests later
    assert (second["turn"], second["prompt_blocks"], second["new_blocks"]) == (1, 6, 3)
    assert second["seconds_since_turn"] == 12.0 and second["output_tokens"] == 300
    assert not second["continued"] and not other["continued"]
    assert math.isclose(second["log_gap"], math.log(2 * len(rows)))
