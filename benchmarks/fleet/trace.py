"""A prefix-block trace made into a workload a 2-core machine can replay.

Trace format (``../shared/traces/README.md``, ``benchmarks/traces/README.md``): one JSON
object per line with ``timestamp`` (ms), ``input_length``, ``output_length`` and
``hash_ids``, one id per 512-token block, each id naming its whole prefix.

Scaling, in order (:class:`Scaling`; :meth:`Workload.describe` prints it):

1. **Sample whole conversations, not requests.** A request belongs to the conversation
   named by its first hash id that at most 5% of the trace's requests share (in the
   conversation trace that is ``hash_ids[1]``: ``hash_ids[0]`` is one system prompt
   every request starts with; in the agentic trace the first block after the agent
   prompt).  A conversation is kept when ``crc32(str(id)) % sample_every == 0``.
   Keeping the first N requests instead keeps almost no reuse (conversation trace:
   first 200 requests, prefix-block hit 0.06; 1 in 60 conversations, 193 requests, 0.35).
2. **Tokens**: ``block_tokens`` tokens per hash block (512 in the trace), at most
   ``max_blocks`` blocks per prompt (the model has 8192 positions); the prompt is the
   blocks' tokens cut to the input length scaled by ``block_tokens / 512``.  Each block's
   ids come from ``random.Random(hash_id)`` over the model's vocabulary (3..1023): the
   same hash is the same tokens, so shared prefixes really are shared.
3. **Outputs**: ``output_length / output_divisor``, at least 1, at most ``max_output``.
4. **Time**: arrivals relative to the first kept request, divided by ``speedup``.
5. ``requests``: the first N requests of the sample (``None``: all).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import random
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TRACE_BLOCK_TOKENS = 512
VOCAB = (3, 1024)  # the test model's word ids w3..w1023 (w0..w2 are its special tokens)
CONVERSATION_SHARE = 0.05
"""A hash id shared by more than this share of the trace's requests is a system or agent
prompt, not a conversation."""


@dataclasses.dataclass(frozen=True)
class Scaling:
    sample_every: int = 60
    block_tokens: int = 128
    max_blocks: int = 40
    output_divisor: int = 16
    max_output: int = 32
    speedup: float = 20.0
    requests: int | None = None


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of the scaled workload; ``blocks`` are the trace's hash ids it covers."""

    index: int
    arrival_s: float
    blocks: tuple[int, ...]
    prompt: tuple[int, ...]
    max_tokens: int


def block_tokens(hash_id: int, n: int) -> list[int]:
    """The ``n`` token ids of one hash block: the same hash id gives the same tokens."""
    rng = random.Random(hash_id)
    return [rng.randrange(*VOCAB) for _ in range(n)]


def conversation_keys(rows: Sequence[dict[str, Any]]) -> list[int]:
    """Each request's conversation: its first hash id at most 5% of the requests share."""
    shared: collections.Counter[int] = collections.Counter()
    for row in rows:
        shared.update(set(row["hash_ids"]))
    limit = CONVERSATION_SHARE * len(rows)
    keys = []
    for row in rows:
        ids = row["hash_ids"]
        keys.append(next((h for h in ids if shared[h] <= limit), ids[-1]))
    return keys


def prefix_block_hit(requests: Sequence[Sequence[int]]) -> float:
    """Share of blocks that are a leading run of blocks some earlier request had (an
    unbounded prefix cache's block hit rate over the requests in order)."""
    seen: set[int] = set()
    hit = total = 0
    for ids in requests:
        lead = 0
        while lead < len(ids) and ids[lead] in seen:
            lead += 1
        hit += lead
        total += len(ids)
        seen.update(ids)
    return hit / total if total else 0.0


class Workload:
    """The scaled requests of one trace (:attr:`requests`) and how they were made."""

    def __init__(self, path: Path, scaling: Scaling):
        if not path.exists():
            raise FileNotFoundError(f"trace {path} is missing (see benchmarks/traces/README.md)")
        self.path, self.scaling = path, scaling
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r["hash_ids"]]
        self.trace_requests = len(rows)
        self.trace_hit = prefix_block_hit([r["hash_ids"] for r in rows])
        keys = conversation_keys(rows)
        kept = [r for r, k in zip(rows, keys) if zlib.crc32(str(k).encode()) % scaling.sample_every == 0]
        self.conversations = len({k for k in keys if zlib.crc32(str(k).encode()) % scaling.sample_every == 0})
        self.sampled = len(kept)
        if scaling.requests is not None:
            kept = kept[: scaling.requests]
        if not kept:
            raise ValueError(f"sampling 1 in {scaling.sample_every} conversations of {path} kept no request")
        self.sample_hit = prefix_block_hit([r["hash_ids"] for r in kept])
        self.requests = [self._scale(i, row, kept[0]["timestamp"]) for i, row in enumerate(kept)]
        self.scaled_hit = prefix_block_hit([r.blocks for r in self.requests])

    def _scale(self, index: int, row: dict[str, Any], t0_ms: float) -> Request:
        s = self.scaling
        blocks = tuple(row["hash_ids"][: s.max_blocks])
        wanted = max(1, round(row["input_length"] * s.block_tokens / TRACE_BLOCK_TOKENS))
        length = min(wanted, len(blocks) * s.block_tokens)
        n_blocks = -(-length // s.block_tokens)
        blocks = blocks[:n_blocks]
        prompt = [t for h in blocks for t in block_tokens(h, s.block_tokens)][:length]
        max_tokens = min(s.max_output, max(1, row["output_length"] // s.output_divisor))
        arrival_s = (row["timestamp"] - t0_ms) / 1000 / s.speedup
        return Request(index, arrival_s, blocks, tuple(prompt), max_tokens)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    def describe(self) -> str:
        s, n = self.scaling, len(self.requests)
        lengths = sorted(len(r.prompt) for r in self.requests)
        return "\n".join(
            [
                f"trace {self.path.name}: {self.trace_requests} requests, unbounded prefix-block hit "
                f"{self.trace_hit:.2f}",
                f"  sample: 1 in {s.sample_every} conversations (crc32 of each request's conversation id) -> "
                f"{self.conversations} conversations, {self.sampled} requests, prefix-block hit {self.sample_hit:.2f}"
                + (f"; first {n} kept" if s.requests is not None else ""),
                f"  tokens: {s.block_tokens} per hash block (trace: {TRACE_BLOCK_TOKENS}), at most {s.max_blocks} "
                f"blocks; prompts {lengths[0]}..{lengths[-1]} tokens (median {lengths[n // 2]}), "
                f"{self.prompt_tokens()} in all; prefix-block hit after the cap {self.scaled_hit:.2f}",
                f"  outputs: trace length / {s.output_divisor}, at most {s.max_output} tokens; time: / {s.speedup:g} "
                f"-> {n} requests over {self.duration_s:.0f} s ({n / max(self.duration_s, 1e-9):.2f} requests/s)",
            ]
        )
