"""The ``lfuda`` eviction policy: LFU with dynamic aging, made for prefix chains
(:class:`.base.EvictionPolicy`; the order :mod:`.adaptive` builds on).

Each chunk's state is one int (see below); the policy keeps a heap of them and a
bounded frequency history of evicted keys (:mod:`.history`).

Primitives: :class:`LFUDAPolicy`, ``_slot`` (a state's slot in the key table,
for :mod:`.adaptive`).
"""

from __future__ import annotations

import array
import heapq
from collections.abc import Callable

from ..base import ChunkKey
from .history import KeyHistory, key_hash

# A chunk's state is one int (no object per chunk): its rank (priority, tie-break,
# sequence; see _rank) in the high bits, so that the int orders as the rank does
# and is its own heap item (no tuple), then the chunk's slot in the policy's key
# table (how a heap item finds its key), and below it the depth (chunks before it
# in its known prefix chain, 0: unknown or a head), the frequency (accesses,
# counting those before an eviction the history remembers) and the tail flag
# (the last chunk of a multi-chunk put, not read since: one access fewer).
_SLOT_SHIFT = 64
_SLOT_MAX = (1 << 32) - 1
_META = _SLOT_SHIFT + 32
_FREQ_MAX = (1 << 32) - 1
_DEPTH_MAX = (1 << 31) - 1


def _freq(state: int) -> int:
    return (state >> 1) & _FREQ_MAX


def _depth(state: int) -> int:
    return (state >> 33) & _DEPTH_MAX


def _slot(state: int) -> int:
    return (state >> _SLOT_SHIFT) & _SLOT_MAX


class LFUDAPolicy:
    """LFU with dynamic aging (Arlitt et al., 2000), made for prefix chains.

    - Each chunk has the priority ``H = L + freq``; the victim is the lowest
      ``H``.  ``L`` (the cache "age") becomes the victim's ``H`` at every
      eviction, so a chunk that stops being read sinks below newcomers after a
      while however often it was read before: frequency and recency together.
    - ``freq`` survives an eviction in a bounded history (``ghost_factor`` x the
      chunks held, at least ``min_ghost``; 8-byte key hashes, oldest forgotten
      first): a chunk coming back is known to be reused and enters with its
      count, above the one-off chunks that make up most of an LLM workload.
    - Ties in ``H`` (most one-off chunks share one) go to the oldest touch,
      counted in chunk operations, minus ``depth_penalty`` per chunk of known
      prefix before it: under pressure the tails of chains leave before their
      heads, and a head stays useful (a hit needs every chunk before it) while
      an orphaned tail never is.
    - Put tails count one access fewer (``tails_first``).  The last chunk of
      a put of two or more chunks, until it is read, has ``H = L + freq - 1``:
      a new one ranks with the oldest one-offs, not above them.  It is the
      deepest chunk of its prompt and usually partial: the next turn of the
      conversation extends the prompt, so that chunk's tokens, and key,
      change, and the old key is never asked for again (on the trace, 126 of
      12,031 put tails are ever read).  It is known to be a tail when the
      next put begins (``admit`` with no parent after one with a parent):
      the tiered store reserves a put's chunks together, so no hook beyond
      ``admit`` is needed.  A single-chunk put has no tail (promotions,
      chunk-at-a-time clients), and a tail read before or after it is known
      is an ordinary chunk.  Ranking it lower only by one access, not below
      everything, keeps a workload whose last chunks are reused safe (sending
      tails to the very bottom gains another 0.001 to 0.002 on the trace).
    - Admission: every chunk is admitted.  Refusing one-off chunks (first
      sightings, or tails beyond a depth) wins at tiny capacities and loses
      more above them (``docs/eviction.md``); the ordering above already sends
      them out first.  A refused chunk would also never reach the disk tier.

    Costs: ``admit`` O(log n) when it marks a tail (once per put), else
    O(1); ``inserted``, ``touched`` O(log n); ``removed`` O(1) amortised;
    ``victim`` O(log n) amortised (a binary heap with lazy deletion, rebuilt
    when stale items outnumber live ones).  Memory: a chunk's state is one int
    (rank, key slot, depth, frequency, tail flag), which is also its heap item,
    so per cached chunk there is a dict slot, that int, its pointer in the heap
    and in the key table (plus at most one stale int in the heap, of a chunk
    touched since it was pushed); the history costs 6 bytes per remembered key
    (:mod:`.history`), 8 per cached chunk by default.  The key objects are the
    tier's own.  ``benchmarks/bench_scale.py`` measures it (docs/eviction.md).
    """

    name = "lfuda"

    def __init__(
        self, ghost_factor: int = 8, min_ghost: int = 4096, depth_penalty: int = 256, tails_first: bool = True
    ) -> None:
        self.ghost_factor = ghost_factor
        self.min_ghost = min_ghost
        self.depth_penalty = depth_penalty
        self.tails_first = tails_first
        self._entries: dict[ChunkKey, int] = {}  # key -> its state (see _META)
        self._heap: list[int] = []  # states: stale once their key's state changed
        self._keys: list[ChunkKey | None] = []  # slot -> key (None: free)
        self._free = array.array("I")  # free slots of _keys
        self._ghost = KeyHistory(min_ghost)  # key_hash(key) -> freq
        self._age = 0  # L
        self._clock = 0  # chunk operations so far
        self._seq = 0
        self._last: tuple[ChunkKey | None, int] = (None, 0)  # the last inserted key and its depth
        self._open: ChunkKey | None = None  # the last key admitted with a parent: the open put's tail so far
        self._pending_tail: ChunkKey | None = None  # a finished put's tail not inserted yet
        self._named: tuple[ChunkKey | None, int] = (None, 0)  # the last victim named, and its priority

    # -- the interface -------------------------------------------------------------
    def admit(self, key: ChunkKey, size: int, parent: ChunkKey | None) -> bool:
        if parent is None and self._open is not None and self.tails_first:
            # A new put begins: the previous one's last chunk is its tail.
            tail, self._open = self._open, None
            state = self._entries.get(tail)
            if state is None:
                self._pending_tail = tail  # reserved, not yet inserted (or gone)
            elif not state & 1:
                self._push(tail, _freq(state), _depth(state), True)
        self._open = key if parent is not None else None
        return True

    def inserted(self, key: ChunkKey, size: int, parent: ChunkKey | None) -> None:
        depth = 0
        if parent is not None:
            known = self._entries.get(parent)
            if known is not None:
                depth = _depth(known) + 1
            elif parent == self._last[0]:  # evicted to make room for this very chunk
                depth = self._last[1] + 1
        freq = (self._ghost.pop(key_hash(key)) if len(self._ghost) else 0) + 1  # no hash while empty: a rebuild
        self._clock += 1
        tail = key == self._pending_tail
        if tail:
            self._pending_tail = None
        self._push(key, freq, depth, tail)
        self._last = (key, depth)

    def inserted_many(self, keys: list[ChunkKey]) -> None:
        """``inserted(key, size, None)`` for each of ``keys`` in order (an index
        rebuilt at a restart), the same states in bulk: with no history to
        consult, no free slot and no pending tail, the i-th key's state is the
        first one's plus i steps of clock, sequence and slot, so the states are
        one ``range`` and the heap takes them in one heapify.  Otherwise, or for
        a key it holds already, one by one.  The keys must be distinct."""
        n = len(keys)
        slot0, tie0 = len(self._keys), self._clock + 1 + _TIE_OFFSET
        seq0 = self._seq + 1
        bulk = (
            n > 0
            and not len(self._ghost)
            and not self._free
            and self._pending_tail is None
            and slot0 + n - 1 <= _SLOT_MAX
            and tie0 + n <= (1 << _FIELD) - 1
            and seq0 + n <= (1 << _FIELD) - 1
            and not any(map(self._entries.__contains__, keys))
        )
        if not bulk:
            for key in keys:
                self.inserted(key, 0, None)
            return
        priority = self._age + 1  # freq 1, no tail
        rank0 = _rank(priority, self._clock + 1, seq0)
        first = (rank0 << _META) | (slot0 << _SLOT_SHIFT) | (1 << 1)
        step = (1 << (_META + _FIELD)) + (1 << _META) + (1 << _SLOT_SHIFT)  # tie, sequence and slot each + 1
        states = range(first, first + n * step, step)
        before = len(self._entries)
        self._keys.extend(keys)
        self._entries.update(zip(keys, states))
        if len(self._entries) != before + n:
            raise ValueError("inserted_many: a key listed twice")  # the callers pass distinct keys
        self._heap.extend(states)
        if len(self._heap) > n:
            heapq.heapify(self._heap)
        self._clock += n
        self._seq += n
        self._last = (keys[-1], 0)

    def touched(self, key: ChunkKey) -> None:
        state = self._entries.get(key)
        if state is None:
            return
        self._clock += 1
        if key == self._open:
            self._open = None  # read before its put was known to be over: not a tail
        self._push(key, _freq(state) + 1, _depth(state), False)  # read after all: not a tail

    def removed(self, key: ChunkKey) -> None:
        state = self._entries.pop(key, None)
        if state is None:
            return
        slot = _slot(state)
        self._keys[slot] = None
        self._free.append(slot)
        if key == self._named[0]:  # the victim left: L becomes its H (never going back)
            self._age = max(self._age, self._named[1])
            self._named = (None, 0)
        self._ghost.bound(max(self.min_ghost, self.ghost_factor * len(self._entries)))
        self._ghost.add(key_hash(key), _freq(state))

    def victim(self, skip: Callable[[ChunkKey], bool]) -> ChunkKey | None:
        heap = self._heap
        skipped: list[int] = []
        found: ChunkKey | None = None
        keys, entries = self._keys, self._entries
        while heap:
            state = heap[0]
            key = keys[(state >> _SLOT_SHIFT) & _SLOT_MAX]
            if key is None or entries.get(key) != state:
                heapq.heappop(heap)  # stale: the chunk was touched again or removed (its slot maybe reused)
                continue
            if skip(key):
                skipped.append(heapq.heappop(heap))
                continue
            found = key
            # L moves when the victim is removed, not now: the tier may keep it (a spill declined).
            self._named = (found, state >> (_META + _PRIORITY_SHIFT))
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return found

    def order(self) -> list[ChunkKey]:
        return sorted(self._entries, key=self._entries.__getitem__)

    def holds(self, key: ChunkKey) -> bool:
        """Whether ``key`` is one of the chunks it orders."""
        return key in self._entries

    def remembers(self, key: ChunkKey) -> bool:
        """Whether ``key`` is in the history of recently evicted keys."""
        return key_hash(key) in self._ghost

    @property
    def chunks(self) -> int:
        """Chunks it orders.  (No ``__len__``: an empty policy must not be falsy,
        or ``policy or LRUPolicy()`` would silently replace it.)"""
        return len(self._entries)

    # -- internals -----------------------------------------------------------------
    def is_tail(self, key: ChunkKey) -> bool:
        """Whether ``key`` is ranked as a put tail (one access fewer)."""
        return bool(self._entries.get(key, 0) & 1)

    def _push(self, key: ChunkKey, freq: int, depth: int, tail: bool) -> None:
        """Set the chunk's state and push its heap item (the old one goes stale)."""
        self._seq += 1
        # A put tail counts one access fewer: a new one ranks with the chunks at L.
        priority = self._age + freq - (1 if tail else 0)
        rank = _rank(priority, self._clock - self.depth_penalty * depth, self._seq)
        freq, depth = min(freq, _FREQ_MAX), min(depth, _DEPTH_MAX)
        old = self._entries.get(key)
        if old is not None:
            slot = _slot(old)
        elif self._free:
            slot = self._free.pop()
            self._keys[slot] = key
        else:
            slot = len(self._keys)
            if slot > _SLOT_MAX:
                raise OverflowError(f"more than {_SLOT_MAX + 1} chunks in one policy")
            self._keys.append(key)
        state = (rank << _META) | (slot << _SLOT_SHIFT) | (depth << 33) | (freq << 1) | tail
        self._entries[key] = state
        heapq.heappush(self._heap, state)
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._heap = list(self._entries.values())
            heapq.heapify(self._heap)


_FIELD = 48  # bits of the tie-break and of the sequence number in a rank
_TIE_OFFSET = 1 << (_FIELD - 1)
_PRIORITY_SHIFT = 2 * _FIELD


def _rank(priority: int, tie: int, seq: int) -> int:
    """``(priority, tie, seq)`` as one int that orders as the tuple would: one int
    object per chunk instead of a tuple of three (``priority`` >= 0, ``|tie|`` and
    ``seq`` below 2**47: 10**14 chunk operations)."""
    tie = min(max(tie + _TIE_OFFSET, 0), (1 << _FIELD) - 1)
    return (priority << _PRIORITY_SHIFT) | (tie << _FIELD) | (seq & ((1 << _FIELD) - 1))
