"""The replay buffer: the last published batches, for subscribers that missed some.

Bounded in bytes (``events_replay_size``; a batch's size varies a lot: one
event or a few hundred, each with a chunk's token ids); the oldest fall out.
Every sequence number is kept in order, so what a subscriber gets from
``since(seq)`` has no gaps (if the oldest it asked for is still here).

Primitive: :class:`ReplayBuffer` (``append``, ``since``).
"""

from __future__ import annotations

import itertools
from collections import deque


class ReplayBuffer:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._batches: deque[tuple[int, bytes, bytes]] = deque()

    def __len__(self) -> int:
        return len(self._batches)

    def append(self, seq: int, topic: bytes, payload: bytes) -> None:
        """Keep a batch (``seq`` one more than the last), dropping the oldest beyond ``max_bytes``."""
        self._batches.append((seq, topic, payload))
        self.nbytes += len(topic) + len(payload)
        while self.nbytes > self.max_bytes and len(self._batches) > 1:
            _, old_topic, old_payload = self._batches.popleft()
            self.nbytes -= len(old_topic) + len(old_payload)

    def since(self, start: int) -> list[tuple[int, bytes, bytes]]:
        """Every kept batch with a sequence number >= ``start``, oldest first (a copy:
        the buffer may move on while they are sent)."""
        if not self._batches or start > self._batches[-1][0]:
            return []
        skip = max(0, start - self._batches[0][0])  # sequence numbers are consecutive
        return list(itertools.islice(self._batches, skip, None))
