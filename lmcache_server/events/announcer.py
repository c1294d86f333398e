"""What the tiered store tells us -> KV events, one topic per model.

Implements :class:`..storage.base.Residency`:

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
from array import array
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
        self._where: dict[ChunkKey, bytes] = {}  # announced chunk -> its topic
        self._medium: dict[bytes, str] = {}  # topic -> the medium its chunks were announced with

    def topic(self, namespace: str) -> bytes:
        topic = self._topics.get(namespace)
        if topic is None:
            topic = render_topic(self.settings.topic, namespace, self.settings.node).encode()
            self._topics[namespace] = topic
            self._index.setdefault(topic, BlockIndex())
        return topic

    # -- Residency -------------------------------------------------------------------
    def stored(self, key: ChunkKey, tokens: ChunkTokens, tier: str) -> None:
        try:
            self._stored(key, tokens, tier)
        except Exception:
            self._failed("stored")

    def removed(self, key: ChunkKey) -> None:
        try:
            self._removed(key)
        except Exception:
            self._failed("removed")

    def cleared(self, namespace: str | None) -> None:
        try:
            self._cleared(namespace)
        except Exception:
            self._failed("cleared")

    def _failed(self, what: str) -> None:
        self.counters.errors += 1
        logger.exception("KV event (%s) not published", what)

    def _stored(self, key: ChunkKey, tokens: ChunkTokens, tier: str) -> None:
        bs = self.settings.block_size
        if key in self._where:
            return
        if not tokens.packed or len(tokens.packed) % (4 * bs):
            self.counters.skipped_chunks += 1
            return
        topic = self.topic(key.namespace)
        hashes = block_hashes(key.digest, tokens.parent, tokens.packed, bs)
        shared = self._index[topic].add(key, hashes)
        self._where[key] = topic
        medium = self._medium.setdefault(topic, MEDIUM.get(tier, tier.upper()))
        self.counters.announced_chunks += 1
        if shared == len(hashes):
            return  # every block already announced by another chunk
        parent = parent_hash(tokens.parent) if shared == 0 else hashes[shared - 1]
        ids = array("I")
        ids.frombytes(tokens.packed[shared * 4 * bs :])
        self.publisher.publish(topic, [block_stored(hashes[shared:], parent, ids.tolist(), bs, medium)])

    def announced(self, key: ChunkKey) -> bool:
        return key in self._where

    def _removed(self, key: ChunkKey) -> None:
        topic = self._where.pop(key, None)
        if topic is None:
            return
        medium = self._medium[topic]
        self.counters.removed_chunks += 1
        gone = self._index[topic].remove(key)
        if gone:
            self.publisher.publish(topic, [block_removed(gone, medium)])

    def _cleared(self, namespace: str | None) -> None:
        self.counters.clears += 1
        if namespace is None:
            for topic, index in self._index.items():
                index.clear()
                self.publisher.publish(topic, [all_cleared()])
            self._where.clear()
            return
        topic = self.topic(namespace)
        index = self._index[topic]
        for key in [k for k in self._where if k.namespace == namespace]:
            del self._where[key]
        gone = index.remove_namespace(namespace)
        if not len(index):
            self.publisher.publish(topic, [all_cleared()])
        elif gone:
            self.publisher.publish(topic, [block_removed(gone, self._medium.get(topic, MEDIUM["memory"]))])

    def stats(self) -> dict[str, Any]:
        return {
            "topics": len(self._index),
            "announced_chunks": len(self._where),
            "announced_blocks": sum(i.blocks for i in self._index.values()),
            **dataclasses.asdict(self.counters),
            **self.publisher.stats(),
        }
