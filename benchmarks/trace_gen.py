"""Seeded generators of prefix-block traces, in the Mooncake trace's JSONL format.

Each line is ``{"timestamp": ms, "input_length": tokens, "output_length":
tokens, "hash_ids": [...]}`` with 512-token blocks, as in
``../shared/traces/mooncake_conversation_trace.jsonl`` (its README): block
``i``'s id names the whole prefix up to the end of that block, so two requests
share an id only where their tokens agree from the start through that block.
A partial last block always gets a fresh id (its content changes when the
context grows), as in the real trace.

Two shapes, different from the conversation trace, to check that an eviction
policy tuned on that trace generalises (``policy_table.py`` runs them all):

- ``zipf-prompts``: many users behind a few long shared system prompts.
  ``prompts`` system prompts of ``prompt_tokens`` tokens (log-uniform), chosen
  with Zipf popularity (exponent ``zipf_s``: a few are hot, a long tail is
  cold); each new request appends a short user message (``user_tokens``,
  log-uniform). With probability ``followup_p`` a request is instead the next
  turn of one of the ``recent_users`` latest conversations (its previous
  output plus a new user message). Poisson arrivals at ``rate_per_s``.
- ``agentic``: bursts of tool-using agent sessions with deep multi-turn chains.
  Bursts of sessions (size 1 + geometric with mean ``burst_mean - 1``) arrive
  every ``burst_gap_s`` on average (exponential); a session starts from one of
  ``agents`` agent prompts (``prompt_tokens``), then runs ``turns`` turns
  (uniform), each ``think_s`` (exponential) after the previous: the request is
  the whole context so far; the next turn's context adds this turn's output
  (``output_tokens``) and a tool result (``tool_tokens``, or ``long_tool_tokens``
  with probability ``long_tool_p``). A session ends after its turns or at
  ``max_context`` tokens.

Ranges are ``(low, high)``, inclusive, drawn log-uniformly for token counts.
The output depends only on the parameters and the seed: same seed, same bytes.

Usage: ``python benchmarks/trace_gen.py zipf-prompts --seed 1 --out benchmarks/traces/zipf_prompts.jsonl``
(``--requests N`` to change the length; the committed traces use the defaults,
see ``benchmarks/traces/README.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import random
import sys
from collections.abc import Iterator
from pathlib import Path

BLOCK_TOKENS = 512
NEWLINE = b"\n"


@dataclasses.dataclass
class _Context:
    """A token sequence as blocks: the ids of its full blocks and the length of its partial tail."""

    full: list[int]
    tail_tokens: int

    @property
    def tokens(self) -> int:
        return BLOCK_TOKENS * len(self.full) + self.tail_tokens


class _Ids:
    """Block ids, numbered from 0 in order of creation."""

    def __init__(self) -> None:
        self.next = 0

    def new(self) -> int:
        self.next += 1
        return self.next - 1

    def extend(self, ctx: _Context, tokens: int) -> _Context:
        """``ctx`` followed by ``tokens`` new tokens (unique content): a new context.
        Its first new full block replaces the old partial tail, so it gets a new id."""
        total = ctx.tail_tokens + tokens
        full = ctx.full + [self.new() for _ in range(total // BLOCK_TOKENS)]
        return _Context(full, total % BLOCK_TOKENS)

    def request(self, ctx: _Context, timestamp_ms: int, output: int) -> dict[str, object]:
        ids = list(ctx.full)
        if ctx.tail_tokens:
            ids.append(self.new())  # a partial block's content is this request's alone
        return {"timestamp": timestamp_ms, "input_length": ctx.tokens, "output_length": output, "hash_ids": ids}


def _log_uniform(rng: random.Random, low_high: tuple[int, int]) -> int:
    low, high = low_high
    return min(high, max(low, int(math.exp(rng.uniform(math.log(low), math.log(high + 1))))))


@dataclasses.dataclass(frozen=True)
class ZipfPrompts:
    """Parameters of the ``zipf-prompts`` shape (see the module docstring)."""

    requests: int = 4000
    prompts: int = 300
    zipf_s: float = 1.1
    prompt_tokens: tuple[int, int] = (1024, 16384)
    user_tokens: tuple[int, int] = (32, 1024)
    output_tokens: tuple[int, int] = (16, 768)
    followup_p: float = 0.25
    recent_users: int = 400
    rate_per_s: float = 4.0

    def generate(self, seed: int) -> Iterator[dict[str, object]]:
        rng = random.Random(seed)
        ids = _Ids()
        weights = [1.0 / (rank**self.zipf_s) for rank in range(1, self.prompts + 1)]
        prompt_len = [_log_uniform(rng, self.prompt_tokens) for _ in range(self.prompts)]
        prompts: dict[int, _Context] = {}  # created at first use: ids in order of appearance
        recent: list[tuple[_Context, int]] = []  # (context sent, its output) of the latest conversations
        t = 0.0
        for _ in range(self.requests):
            t += rng.expovariate(self.rate_per_s)
            if recent and rng.random() < self.followup_p:
                i = rng.randrange(len(recent))
                ctx, out = recent.pop(i)
                ctx = ids.extend(ctx, out + _log_uniform(rng, self.user_tokens))
            else:
                p = rng.choices(range(self.prompts), weights)[0]
                if p not in prompts:
                    prompts[p] = ids.extend(_Context([], 0), prompt_len[p])
                ctx = ids.extend(prompts[p], _log_uniform(rng, self.user_tokens))
            out = _log_uniform(rng, self.output_tokens)
            yield ids.request(ctx, int(t * 1000), out)
            recent.append((ctx, out))
            if len(recent) > self.recent_users:
                recent.pop(0)


@dataclasses.dataclass(frozen=True)
class Agentic:
    """Parameters of the ``agentic`` shape (see the module docstring)."""

    requests: int = 3000
    agents: int = 6
    prompt_tokens: tuple[int, int] = (2048, 8192)
    task_tokens: tuple[int, int] = (64, 2048)
    turns: tuple[int, int] = (4, 40)
    output_tokens: tuple[int, int] = (32, 512)
    tool_tokens: tuple[int, int] = (64, 1536)
    long_tool_tokens: tuple[int, int] = (4096, 24576)
    long_tool_p: float = 0.08
    max_context: int = 65536
    burst_mean: float = 6.0
    burst_gap_s: float = 40.0
    think_s: float = 8.0

    def generate(self, seed: int) -> Iterator[dict[str, object]]:
        rng = random.Random(seed)
        ids = _Ids()
        prompt_len = [_log_uniform(rng, self.prompt_tokens) for _ in range(self.agents)]
        prompts: dict[int, _Context] = {}
        # Events: (time, sequence, session context or None for a burst, turns left).
        events: list[tuple[float, int, _Context | None, int]] = [(0.0, 0, None, 0)]
        seq = 1
        made = 0
        while made < self.requests and events:
            t, _, ctx, left = heapq.heappop(events)
            if ctx is None:  # a burst of new sessions, and the next burst
                size = 1
                while rng.random() > 1.0 / max(1.0, self.burst_mean):
                    size += 1
                for _ in range(size):
                    a = rng.randrange(self.agents)
                    if a not in prompts:
                        prompts[a] = ids.extend(_Context([], 0), prompt_len[a])
                    start = ids.extend(prompts[a], _log_uniform(rng, self.task_tokens))
                    heapq.heappush(events, (t + rng.uniform(0, 2), seq, start, rng.randint(*self.turns)))
                    seq += 1
                heapq.heappush(events, (t + rng.expovariate(1 / self.burst_gap_s), seq, None, 0))
                seq += 1
                continue
            out = _log_uniform(rng, self.output_tokens)
            yield ids.request(ctx, int(t * 1000), out)
            made += 1
            tool = self.long_tool_tokens if rng.random() < self.long_tool_p else self.tool_tokens
            nxt = ids.extend(ctx, out + _log_uniform(rng, tool))
            if left > 1 and nxt.tokens <= self.max_context:
                heapq.heappush(events, (t + rng.expovariate(1 / self.think_s), seq, nxt, left - 1))
                seq += 1


SHAPES: dict[str, type[ZipfPrompts] | type[Agentic]] = {"zipf-prompts": ZipfPrompts, "agentic": Agentic}


def generate(shape: str, seed: int, requests: int | None = None) -> list[dict[str, object]]:
    """The trace of ``shape`` with its default parameters (and ``requests`` if given)."""
    try:
        cls = SHAPES[shape]
    except KeyError:
        raise ValueError(f"unknown trace shape {shape!r}; known: {sorted(SHAPES)}") from None
    params = cls() if requests is None else cls(requests=requests)
    return list(params.generate(seed))


def dumps(rows: list[dict[str, object]]) -> bytes:
    """The JSONL bytes of a trace (the conversation trace's spacing)."""
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--requests", type=int, default=None, help="default: the shape's own")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.requests is not None and args.requests < 1:
        ap.error("--requests must be at least 1")
    data = dumps(generate(args.shape, args.seed, args.requests))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)
    print(f"{args.out}: {data.count(NEWLINE)} requests, {len(data)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
