"""``adaptive``: lfuda, plus an admission rule and an LRU order, each switched on only while it pays.

When the cache is very small next to the working set, a prompt seen for the
first time rarely survives until its conversation's next turn, and storing all
of it pushes out chunks that would have been read. Admitting only the first
chunk of such a put (its *head*, usually the shared system prompt) then wins.
A bigger cache can wait for the next turn, and the same rule loses a lot
there. On the Mooncake conversation trace the rule adds +0.02 at 2% of the
distinct blocks and costs -0.07 at 10% (docs/eviction.md). No fixed threshold
of "small" works across workloads, so the policy measures it online instead:

- Two *experts*, key-only models of this tier at its capacity, see every
  access the real tier sees (its gets' hits and its puts' chunks, in order):
  one admits everything (plain lfuda), the other admits only the head of a
  put whose first chunk it has never seen (not cached, not in its history).
  Each counts the hits it would have served, with exponential decay over
  about four cache-fulls of accesses.
- The real tier applies the head rule (judged by its own cache and history)
  while the head-rule expert is ahead, and admits everything otherwise.

Frequency is not always the right order either. Where sessions re-read their
whole, growing context at every turn and then end (agentic traces,
``benchmarks/traces/agentic.jsonl``), a finished session's chunks have high
counts and outstay the live ones: there LRU beats lfuda by up to 0.02 at
5-20% of the distinct blocks.  So a third expert, a key-only LRU cache of
the same size that admits everything, counts its hits too, on counts that
decay four times slower (over about 16 cache-fulls: a switch of order is
slow to pay back, and a faster count flips on noise and lost 0.0008 at 2% on
the conversation trace).  While it is strictly ahead of both lfuda experts
on those counts, the real tier evicts least recently used first
(``recency_order``); otherwise in lfuda's order.  The tier keeps both orders
of the chunks it holds at all times (lfuda's heap and a recency list of
lfuda's slot numbers, 8 bytes a chunk), so a switch moves nothing.

With neither on, the policy behaves exactly like lfuda.

Costs: each access is also played to two lfuda instances and one LRU list of
the same size, so there is about three times lfuda's CPU per operation; each
is still O(log n).  The recency list costs 8 bytes per cached chunk.
In the daemon the experts see the accesses after the request that made them
has been answered (queued, played in order by the event loop's next callback),
so a request waits for lfuda's share only; the head rule follows the experts
one batch late.
The experts count capacity in chunks: the tier's bytes divided by the mean
size of the chunks put so far. That is exact for the uniform chunks of one
model.

Sampling (SHARDS-style): a tier of C >= 16,384 chunks would cost two more
copies of lfuda's bookkeeping per cached chunk, so the experts see only the
keys whose 64-bit hash (:func:`.history.key_hash`) ends in k zero bits, k the
largest with C / 2**k >= 8,192 (fixed at the first capacity known), and each
models a cache of C / 2**k chunks. A put as sampled starts at its first
sampled chunk, which decides the head rule as the put's head would (first
seen by the expert or not). Smaller tiers (all of the trace's 2% and 5%
figures) are modelled exactly. With 1 key in 4 the hit rates on the trace
stay within 0.01 of the exact experts' (tests/test_history.py). Memory: the
experts remember 2 evicted keys per cached chunk (lfuda: 8), each head rule 4
refused keys per cached chunk, 6 and 4 bytes each (:mod:`.history`);
``benchmarks/bench_scale.py`` measures the bytes per cached chunk.
"""

from __future__ import annotations

import array
import asyncio
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator

from ..base import ChunkKey
from .history import KeyHistory, key_hash
from .lfuda import LFUDAPolicy, _slot

_EXPERT_GHOST_FACTOR = 2
_DECAY_CACHEFULS = 4
_REFUSED_FACTOR = 4  # refused keys remembered per cached chunk (at least _MIN_REFUSED)
_MIN_REFUSED = 4096
_SLOW_CACHEFULS = 16
_NIL = (1 << 32) - 1  # no slot (a list end)
_MIN_SAMPLED = 8192  # the experts model at least this many chunks: sampling starts at twice it


def _never(key: ChunkKey) -> bool:
    return False


class _Refused:
    """Hashes of the chunks a head rule refused lately (bounded, oldest forgotten first):
    a put that begins with one continues a prompt seen before, whose tail was not stored."""

    __slots__ = ("_keys",)

    def __init__(self) -> None:
        self._keys = KeyHistory(_MIN_REFUSED, with_values=False)

    def add(self, key: ChunkKey, cached: int) -> None:
        self._keys.bound(max(_MIN_REFUSED, _REFUSED_FACTOR * cached))
        self._keys.add(key_hash(key))

    def __contains__(self, key: ChunkKey) -> bool:
        return key_hash(key) in self._keys


def _first_seen(policy: LFUDAPolicy, refused: _Refused, key: ChunkKey) -> bool:
    """Neither cached, nor among the recently evicted, nor among the recently refused."""
    return not policy.holds(key) and not policy.remembers(key) and key not in refused


class _Expert:
    """A key-only model of the tier under one admission rule, counting its hits."""

    __slots__ = ("order", "head_only", "hits", "slow", "_refusing", "_refused")

    def __init__(self, head_only: bool):
        self.order = LFUDAPolicy(ghost_factor=_EXPERT_GHOST_FACTOR)
        self.head_only = head_only
        self.hits = 0.0
        self.slow = 0.0  # the same count, decayed over _SLOW_CACHEFULS
        self._refusing = False
        self._refused = _Refused()

    def access(self, key: ChunkKey, parent: ChunkKey | None, put: bool, capacity: int, head: bool) -> None:
        """``put``: a new chunk of a put (``parent``: the chunk before it in that put,
        None for the first one the expert sees; ``head``: it is the put's first
        chunk); else a hit of the real tier (a get, or a put that found the chunk stored)."""
        order = self.order
        if order.holds(key):
            order.touched(key)
            self.hits += 1
            self.slow += 1
            return
        if not put:  # a chunk the real tier held: here it misses, and the engine puts it back
            parent = None
        elif parent is None:
            self._refusing = self.head_only and _first_seen(order, self._refused, key)
        order.admit(key, 1, parent)
        if put and not head and self._refusing:
            self._refused.add(key, order.chunks)
            return
        while order.chunks >= capacity and (victim := order.victim(_never)) is not None:
            order.removed(victim)
        order.inserted(key, 1, parent)


class _SlotList:
    """A doubly linked list of slot numbers (lfuda's slots: one per chunk held) in
    two arrays of 4-byte links: LRU order at 8 bytes a chunk, O(1) per change."""

    __slots__ = ("_prev", "_next", "_head", "_tail")

    def __init__(self) -> None:
        self._prev = array.array("I")
        self._next = array.array("I")
        self._head = self._tail = _NIL

    def link(self, slot: int) -> None:
        """Append ``slot`` (not in the list) at the most recent end."""
        grow = slot + 1 - len(self._prev)
        if grow > 0:
            self._prev.extend(itertools.repeat(_NIL, grow))
            self._next.extend(itertools.repeat(_NIL, grow))
        self._prev[slot], self._next[slot] = self._tail, _NIL
        if self._tail == _NIL:
            self._head = slot
        else:
            self._next[self._tail] = slot
        self._tail = slot

    def unlink(self, slot: int) -> None:
        """Take ``slot`` (in the list) out."""
        prev, nxt = self._prev[slot], self._next[slot]
        if prev == _NIL:
            self._head = nxt
        else:
            self._next[prev] = nxt
        if nxt == _NIL:
            self._tail = prev
        else:
            self._prev[nxt] = prev

    def to_end(self, slot: int) -> None:
        if slot != self._tail:
            self.unlink(slot)
            self.link(slot)

    def __iter__(self) -> Iterator[int]:
        """Slots, least recent first."""
        slot = self._head
        while slot != _NIL:
            yield slot
            slot = self._next[slot]


class _RecencyExpert:
    """A key-only LRU model of the tier (admits everything), counting its hits."""

    __slots__ = ("order", "hits", "slow")

    def __init__(self) -> None:
        self.order: OrderedDict[ChunkKey, None] = OrderedDict()
        self.hits = 0.0
        self.slow = 0.0  # the same count, decayed over _SLOW_CACHEFULS

    def access(self, key: ChunkKey, parent: ChunkKey | None, put: bool, capacity: int, head: bool) -> None:
        """As :meth:`_Expert.access`: a hit moves the key to the end, a miss is stored."""
        order = self.order
        if key in order:
            order.move_to_end(key)
            self.hits += 1
            self.slow += 1
            return
        while len(order) >= capacity:
            order.popitem(last=False)
        order[key] = None


class AdaptivePolicy(LFUDAPolicy):
    """lfuda that refuses a first-seen put's tail chunks, or evicts least recently used
    first, while that would have served more hits."""

    name = "adaptive"

    def __init__(self, capacity_bytes: int | None = None, alignment: int = 1) -> None:
        super().__init__()
        self.capacity_bytes = capacity_bytes
        self.alignment = alignment  # the tier allocates in multiples of it
        self.head_rule = False
        """Whether the head rule is in force now."""
        self.recency_order = False
        """Whether victims are chosen least recently used first now (else in lfuda's order)."""
        self.switches = 0
        """Times the head rule turned on or off."""
        self.recency_switches = 0
        """Times the recency order turned on or off."""
        self._all = _Expert(head_only=False)
        self._heads = _Expert(head_only=True)
        self._recency = _RecencyExpert()
        self._recent = _SlotList()  # lfuda's slots of the chunks it holds, least recently used first
        self._admitted_bytes = 0
        self._admitted_chunks = 0
        self._refusing = False
        self._refused = _Refused()
        self._sample_bits: int | None = None  # the experts see keys whose hash ends in this many zero bits
        self._sampled_parent: ChunkKey | None = None  # the open put's last chunk in the sample
        self._plays: list[tuple[ChunkKey, ChunkKey | None, bool]] = []  # accesses the experts have yet to see

    def capacity_chunks(self) -> int | None:
        """The tier's capacity in chunks of the mean size put so far, as allocated (None: not known yet)."""
        if not self.capacity_bytes or not self._admitted_chunks:
            return None
        return max(1, self.capacity_bytes * self._admitted_chunks // max(1, self._admitted_bytes))

    def _later(self, key: ChunkKey, parent: ChunkKey | None, put: bool) -> None:
        """Play an access to the experts: in an event loop, after the current callback
        (the request's reply goes out first: the experts are two thirds of the
        policy's CPU and nothing the request waits for), in order; without a loop,
        at once.  The head rule in force lags the experts by what is queued then."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._play(key, parent, put)
            return
        if not self._plays:
            loop.call_soon(self.play_queued)
        self._plays.append((key, parent, put))

    def play_queued(self) -> None:
        """Play every access queued for the experts, in order."""
        plays, self._plays = self._plays, []
        for key, parent, put in plays:
            self._play(key, parent, put)

    def _play(self, key: ChunkKey, parent: ChunkKey | None, put: bool) -> None:
        capacity = self.capacity_chunks()
        if capacity is None:
            return
        head = parent is None
        if self._sample_bits is None:  # fixed at the first capacity known: the experts' keys stay comparable
            self._sample_bits = max(0, (capacity // _MIN_SAMPLED).bit_length() - 1)
        bits = self._sample_bits
        if bits:
            if put and head:
                self._sampled_parent = None  # a new put
            if key_hash(key) & ((1 << bits) - 1):
                return  # not in the sample: the experts see 1 key in 2**bits, and model a cache that much smaller
            if put:  # the put as sampled: its first sampled chunk decides the head rule, as its head would
                parent, self._sampled_parent = self._sampled_parent, key
            capacity = max(1, capacity >> bits)
        keep = 1.0 - 1.0 / (_DECAY_CACHEFULS * capacity)
        keep_slow = 1.0 - 1.0 / (_SLOW_CACHEFULS * capacity)
        for expert in (self._all, self._heads, self._recency):
            expert.hits *= keep
            expert.slow *= keep_slow
            expert.access(key, parent, put, capacity, head)
        recency = self._recency.slow > max(self._all.slow, self._heads.slow)  # ties: lfuda's order
        heads = self._heads.hits > self._all.hits
        if heads != self.head_rule:
            self.head_rule = heads
            self.switches += 1
        if recency != self.recency_order:
            self.recency_order = recency
            self.recency_switches += 1

    def stats(self) -> dict[str, int | bool]:
        """For the tier's stats: whether the head rule is on, whether victims go by
        recency, and how often each changed."""
        self.play_queued()
        return {
            "head_rule": self.head_rule,
            "head_rule_switches": self.switches,
            "recency_order": self.recency_order,
            "recency_order_switches": self.recency_switches,
        }

    def touched(self, key: ChunkKey) -> None:
        self._later(key, None, put=False)
        state = self._entries.get(key)
        if state is not None:
            self._recent.to_end(_slot(state))
        super().touched(key)

    def inserted(self, key: ChunkKey, size: int, parent: ChunkKey | None) -> None:
        held = self._entries.get(key)
        if held is not None:
            self._recent.unlink(_slot(held))
        super().inserted(key, size, parent)
        self._recent.link(_slot(self._entries[key]))

    def inserted_many(self, keys: list[ChunkKey]) -> None:
        held = set(filter(self._entries.__contains__, keys))
        super().inserted_many(keys)
        entries, recent = self._entries, self._recent
        for key in keys:
            if key not in held:
                recent.link(_slot(entries[key]))

    def removed(self, key: ChunkKey) -> None:
        state = self._entries.get(key)
        if state is not None:
            self._recent.unlink(_slot(state))
        super().removed(key)

    def victim(self, skip: Callable[[ChunkKey], bool]) -> ChunkKey | None:
        """lfuda's victim, or the least recently used chunk while the recency expert leads."""
        if not self.recency_order:
            return super().victim(skip)
        keys = self._keys
        for slot in self._recent:
            key = keys[slot]
            if key is not None and not skip(key):
                return key
        return None

    def admit(self, key: ChunkKey, size: int, parent: ChunkKey | None) -> bool:
        self._admitted_bytes += -(-size // self.alignment) * self.alignment
        self._admitted_chunks += 1
        self._later(key, parent, put=True)
        if parent is None:
            self._refusing = self.head_rule and _first_seen(self, self._refused, key)
        admitted = super().admit(key, size, parent)
        if self._refusing and parent is not None:
            self._refused.add(key, self.chunks)
            return False
        return admitted
