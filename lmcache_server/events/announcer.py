"""What the tiered store tells us -> KV events, one topic per model.

Implements :class:`..storage.base.Residency`:

Calls from the store only record what happened (a dict update and an
append): the hashing and the events are built when the batch is flushed
(:meth:`EventPublisher.flush`, a callback of its own on the event loop), so a
put's commit never waits for them.  In that order:

- ``stored``: a chunk whose put carried token ids became readable.  Its
  ``n = tokens / block_size`` blocks are recorded in its topic's
  :class:`.blocks.BlockIndex`, and the blocks no other announced chunk holds
  are published as one ``BlockStored`` (their token ids, the parent hash
  chaining them to the block before).  A chunk whose token count is not a
  whole number of blocks is not announced (``skipped``).  The token ids are
  not kept.
- ``removed``: the chunk left the last local tier; blocks no chunk holds any
  more are published as one ``BlockRemoved``.
- ``cleared``: a clear.  ``AllBlocksCleared`` on the namespace's topic when no
  other namespace has blocks announced there (else a ``BlockRemoved`` of the
  namespace's blocks); a clear of all namespaces clears every topic.

The topic comes from ``topic`` with ``{model}`` (the namespace's model id),
``{namespace}`` (the whole namespace) and ``{node}`` substituted.

Primitives: :class:`EventSettings`, :class:`Announcer`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from lmcache_client.keys import ChunkTokens

from ..storage.base import ChunkKey
from .blocks import BlockIndex, block_hashes, parent_hash
from .publisher import EventPublisher
from .wire import all_cleared, block_removed, block_stored

logger = logging.getLogger(__name__)

MEDIUM = {"memory": "CPU", "disk": "STORAGE"}
"""Our tier names -> the ``medium`` of events (vLLM's MEDIUM_CPU, MEDIUM_STORAGE).
A chunk is announced once, from the tier it first became readable in (a put:
memory), and removed with the same medium; moving between tiers is not announced."""

TOPIC_FIELDS = ("model", "namespace", "node")


def render_topic(template: str, namespace: str, node: str) -> str:
    """``template`` with its placeholders filled for ``namespace`` (ValueError: an unknown one)."""
    try:
        return template.format(model=namespace.split("|", 1)[0], namespace=namespace, node=node)
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(
            f"topic {template!r}: only {{model}}, {{namespace}} and {{node}} may be used ({err})"
        ) from None


@dataclasses.dataclass(frozen=True)
class EventSettings:
    topic: str = "kv@{node}@{model}"
    node: str = "lmcache"
    block_size: int = 16


@dataclasses.dataclass
class AnnouncerCounters:
    announced_chunks: int = 0
    removed_chunks: int = 0
    skipped_chunks: int = 0
    """Puts with token ids that were not a whole number of event blocks."""
    clears: int = 0
    errors: int = 0
    """Unexpected failures while building events (logged; the request is never affected)."""


class Announcer:
    def __init__(self, publisher: EventPublisher, settings: EventSettings):
        self.publisher = publisher
        self.settings = settings
        self.counters = AnnouncerCounters()
        self._topics: dict[str, bytes] = {}  # namespace -> topic
        self._index: dict[bytes, BlockIndex] = {}  # topic -> its announced blocks
        self._where: dict[ChunkKey, bytes] = {}  # announced chunk -> its topic (kept current)
        self._medium: dict[bytes, str] = {}  # topic -> the medium its chunks were announced with
        self._ops: list[tuple[Any, ...]] = []  # what happened since the last flush, in order
        publisher.prepare = self._build

    def topic(self, namespace: str) -> bytes:
        topic = self._topics.get(namespace)
        if topic is None:
            topic = render_topic(self.settings.topic, namespace, self.settings.node).encode()
            self._topics[namespace] = topic
            self._index.setdefault(topic, BlockIndex())
        return topic

    # -- Residency: record only ------------------------------------------------------
    def stored(self, key: ChunkKey, tokens: ChunkTokens, tier: str) -> None:
        try:
            if key in self._where:
                return
            if not tokens.packed or len(tokens.packed) % (4 * self.settings.block_size):
                self.counters.skipped_chunks += 1
                return
            topic = self.topic(key.namespace)
            self._where[key] = topic
            self.counters.announced_chunks += 1
            self._record(("stored", key, topic, tokens, MEDIUM.get(tier, tier.upper())))
        except Exception:
            self._failed("stored")

    def announced(self, key: ChunkKey) -> bool:
        return key in self._where

    def removed(self, key: ChunkKey) -> None:
        topic = self._where.pop(key, None)
        if topic is not None:
            self.counters.removed_chunks += 1
            self._record(("removed", key, topic))

    def cleared(self, namespace: str | None) -> None:
        self.counters.clears += 1
        if namespace is None:
            self._where.clear()
        else:
            for key in [k for k in self._where if k.namespace == namespace]:
                del self._where[key]
        self._record(("cleared", namespace))

    def _record(self, op: tuple[Any, ...]) -> None:
        self._ops.append(op)
        self.publisher.wake(len(self._ops))

    def _failed(self, what: str) -> None:
        self.counters.errors += 1
        logger.exception("KV event (%s) not published", what)

    # -- at flush: the events ----------------------------------------------------------
    def _build(self) -> None:
        ops, self._ops = self._ops, []
        for op in ops:
            try:
                if op[0] == "stored":
                    self._build_stored(*op[1:])
                elif op[0] == "removed":
                    self._build_removed(*op[1:])
                else:
                    self._build_cleared(*op[1:])
            except Exception:
                self._failed(str(op[0]))

    def _build_stored(self, key: ChunkKey, topic: bytes, tokens: ChunkTokens, medium: str) -> None:
        bs = self.settings.block_size
        hashes = block_hashes(key.digest, tokens.parent, tokens.packed, bs)
        shared = self._index[topic].add(key, hashes)
        medium = self._medium.setdefault(topic, medium)
        if shared == len(hashes):
            return  # every block already announced by another chunk
        parent = parent_hash(tokens.parent) if shared == 0 else hashes[shared - 1]
        ids = tokens.packed[shared * 4 * bs :]
        self.publisher.publish(topic, [block_stored(hashes[shared:], parent, ids, bs, medium)])

    def _build_removed(self, key: ChunkKey, topic: bytes) -> None:
        gone = self._index[topic].remove(key)
        if gone:
            self.publisher.publish(topic, [block_removed(gone, self._medium[topic])])

    def _build_cleared(self, namespace: str | None) -> None:
        if namespace is None:
            for topic, index in self._index.items():
                index.clear()
                self.publisher.publish(topic, [all_cleared()])
            return
        topic = self.topic(namespace)
        index = self._index[topic]
        gone = index.remove_namespace(namespace)
        if not len(index):
            self.publisher.publish(topic, [all_cleared()])
        elif gone:
            self.publisher.publish(topic, [block_removed(gone, self._medium.get(topic, MEDIUM["memory"]))])

    def stats(self) -> dict[str, Any]:
        out = {
            "topics": len(self._index),
            "announced_chunks_now": len(self._where),
            "announced_blocks": sum(i.blocks for i in self._index.values()),
            **dataclasses.asdict(self.counters),
            **self.publisher.stats(),
        }
        out["pending_events"] += len(self._ops)
        return out
