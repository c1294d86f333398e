"""A prefix-block trace as the simulators read it (``policy_sim.py``, ``replay_admission.py``).

One JSON object a line, as in ``../shared/traces`` (Mooncake's format):
``timestamp`` (ms), ``input_length`` (tokens) and ``hash_ids`` (one id per
512-token block, a block id naming its whole prefix).  Also a seeded
trace-like workload for tests, a block id's chunk key, and the README's way of
counting a request's hit tokens.

Primitives: :class:`Request`, :func:`load_trace`, :func:`synthetic_requests`,
:func:`block_digest`, :func:`hit_tokens`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections.abc import Iterable
from pathlib import Path

BLOCK_TOKENS = 512


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    timestamp_ms: int
    input_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path, limit: int | None = None) -> list[Request]:
    out: list[Request] = []
    with open(path) as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            if line.strip():
                row = json.loads(line)
                out.append(Request(int(row["timestamp"]), int(row["input_length"]), tuple(row["hash_ids"])))
    return out


def synthetic_requests(n: int, seed: int = 7) -> list[Request]:
    """A trace-like workload for tests: conversations over a shared first block, new ones and
    follow-ups that extend one (a follow-up keeps all but the last block of its previous turn)."""
    rng = random.Random(seed)
    convs: list[list[int]] = []
    next_id = 1
    out = []
    for i in range(n):
        if convs and rng.random() < 0.45:
            j = rng.randrange(max(0, len(convs) - 60), len(convs))
            grow = rng.randint(1, 6)
            ids = convs[j][:-1] + list(range(next_id, next_id + grow))
            convs[j] = ids
        else:
            grow = rng.randint(2, 24)
            ids = [0, *range(next_id, next_id + grow)]
            convs.append(ids)
        next_id += grow
        out.append(Request(i * 100, BLOCK_TOKENS * (len(ids) - 1) + rng.randint(1, BLOCK_TOKENS), tuple(ids)))
    return out


def distinct_blocks(requests: Iterable[Request]) -> int:
    return len({b for r in requests for b in r.hash_ids})


def block_digest(block_id: int) -> bytes:
    """The 32-byte chunk key of a trace block id (deterministic, process-independent)."""
    return hashlib.sha256(b"lmcache-trace-block\0" + block_id.to_bytes(8, "big")).digest()


def hit_tokens(hit_blocks: int, input_length: int) -> int:
    """Prefill tokens saved: the leading hit blocks, never the last token."""
    return max(0, min(BLOCK_TOKENS * hit_blocks, input_length - 1))
