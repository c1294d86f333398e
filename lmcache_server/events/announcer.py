"""What the tiered store tells us -> KV events, one topic per model.

Implements :class:`..storage.base.Residency`:

Calls from the store only record what happened (a dict update and an
append): the hashing and the events are built when the batch is flushed
(:meth:`EventPublisher.flush`, a callback of its own on the event loop), so a
put's commit never waits for them.  In that order:

- ``stored``: a chunk whose put carried token ids became readable.  Its
  ``n = tokens / block_size`` blocks are recorded in the
  :class:`.blocks.BlockIndex` of its topic and medium, and the blocks no
  other announced chunk holds there are published as one ``BlockStored``
  (their token ids, the parent hash chaining them to the block before).  A
  chunk whose token count is not one chunk's (the namespace's ``c<N>``, else
  the daemon's ``chunk_size``: what a put carries), or not a whole number of
  blocks, is not announced (``skipped``): a record read from disk or Redis
  may claim up to 2**20 ids.  The token ids are kept while the chunk stays on the node.
- ``moved``: the fastest local tier holding an announced chunk changed
  (memory -> disk when it leaves memory after its spill, disk -> memory when
  it is promoted): ``BlockStored`` with the new medium for the blocks new
  there, then ``BlockRemoved`` with the old one for the blocks no chunk holds
  there any more (in that order: a router never sees the block nowhere).
- ``removed``: the chunk left the last local tier; blocks no chunk holds any
  more (in its medium) are published as one ``BlockRemoved``.  When this
  node's Redis uplink holds it (:mod:`.remote`) it is ``moved`` to ``REMOTE``
  instead (sent as ``medium: CPU, locality: REMOTE``), and removed once forgotten.
- ``cleared``: a clear.  ``AllBlocksCleared`` on the namespace's topic when no
  other namespace has blocks announced there (else a ``BlockRemoved`` of the
  namespace's blocks); a clear of all namespaces clears every topic.

At start (:meth:`start`) every topic known then gets ``AllBlocksCleared`` in
the first batches of the new epoch, then the chunks kept at the last clean
stop (:mod:`.keep`) that the store still holds are announced again, and those
the disk's scan found with token ids in their records.  :meth:`residency`
answers the snapshot endpoint (:mod:`.snapshot`, which builds its events).

The topic comes from ``topic`` with ``{model}`` (the namespace's model id),
``{namespace}`` (the whole namespace) and ``{node}`` substituted.

Primitives: :class:`EventSettings`, :class:`Announcer`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import zmq.asyncio

from lmcache_client.keys import ChunkTokens
from lmcache_client.namespace import chunk_size_of

from ..storage.base import ChunkKey
from .blocks import BlockIndex, Held, block_hashes, parent_hash
from .keep import Kept
from .publisher import EventPublisher, PublisherSettings
from .remote import LOCAL as LOCAL  # re-exported
from .remote import REMOTE, REMOTE_TIERS, RemoteHeld, RemoteSettings, placement
from .snapshot import SnapshotServer, SnapshotSettings
from .wire import Event, Wire

logger = logging.getLogger(__name__)

MEDIUM = {"memory": "CPU", "disk": "STORAGE"}
"""Our tier names -> the ``medium`` of events (vLLM's MEDIUM_CPU, MEDIUM_STORAGE).
A chunk is announced with the medium of the fastest local tier holding it."""

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
    encoding: str = "map"
    """``map`` (vLLM 0.32) or ``array`` (vLLM before 0.32: llm-d, Conductor; :class:`.wire.Wire`)."""
    chunk_size: int = 256
    """The daemon's ``chunk_size``: the token ids of a chunk whose namespace names no ``c<N>``."""


@dataclasses.dataclass
class AnnouncerCounters:
    announced_chunks: int = 0
    removed_chunks: int = 0
    skipped_chunks: int = 0
    """Chunks with token ids that were not one chunk's worth (a record's may claim more)
    or not a whole number of event blocks: not announced."""
    restored_chunks: int = 0
    """Chunks announced again at start: kept at the last clean stop and found in the store,
    or found on disk with token ids in their records."""
    moved_chunks: int = 0
    """Announced chunks whose medium changed (spilled then dropped from memory, promoted)."""
    clears: int = 0
    errors: int = 0
    """Unexpected failures while building events (logged; the request is never affected)."""


class Announcer:
    """The front of the events room: it builds and holds its parts, each given what it
    uses, the parts that call the announcer back given the announcer itself:

    - ``publisher`` (:class:`.publisher.EventPublisher`): the PUB and replay sockets,
      batching; it calls :meth:`_build` at each flush and :meth:`topics` for heartbeats;
    - ``snapshot_server`` (:class:`.snapshot.SnapshotServer`, with ``snapshot``): the
      snapshot endpoint, reading :meth:`residency`;
    - ``remote`` (:class:`.remote.RemoteHeld`, with ``remote``): what this node's Redis
      uplink holds, so a chunk only Redis holds is announced REMOTE, not removed;
    - ``keep_path``: where a clean stop keeps what was announced (:mod:`.keep`).
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        settings: EventSettings,
        publishing: PublisherSettings,
        *,
        keep_path: Path | None = None,
        snapshot: SnapshotSettings | None = None,
        remote: RemoteSettings | None = None,
    ):
        self.settings = settings
        self.counters = AnnouncerCounters()
        self.wire = Wire(array=settings.encoding == "array")
        self._topics: dict[str, bytes] = {}  # namespace -> topic
        self._index: dict[tuple[bytes, str], BlockIndex] = {}  # (topic, medium) -> its announced blocks
        self._where: dict[ChunkKey, tuple[bytes, str]] = {}  # announced chunk -> (topic, medium), kept current
        self._ops: list[tuple[Any, ...]] = []  # what happened since the last flush, in order
        self._unbuilt: dict[ChunkKey, ChunkTokens] = {}  # stored since the last flush (not in an index yet)
        self.publisher = EventPublisher(context, publishing, prepare=self._build, topics=self.topics)
        self.keep_path = keep_path
        """Where a clean stop keeps what was announced for the next start (:mod:`.keep`)."""
        self.snapshot_server = (
            SnapshotServer(context, snapshot.endpoint, self, timeout_s=snapshot.timeout_s)
            if snapshot is not None
            else None
        )
        self.remote = (
            RemoteHeld(self, remote.redis, max_chunks=remote.max_chunks, ttl_s=remote.ttl_s, audit_s=remote.audit_s)
            if remote is not None
            else None
        )
        """What Redis holds for this node (:mod:`.remote`)."""

    def chunk_ids(self, namespace: str) -> int:
        """The token ids one chunk of ``namespace`` holds: its ``c<N>``, else the daemon's
        ``chunk_size``.  Only chunks with exactly that many are announced."""
        return chunk_size_of(namespace) or self.settings.chunk_size

    def topic(self, namespace: str) -> bytes:
        topic = self._topics.get(namespace)
        if topic is None:
            topic = render_topic(self.settings.topic, namespace, self.settings.node).encode()
            self._topics[namespace] = topic
        return topic

    def topics(self) -> list[bytes]:
        """Every topic used so far (the node's bare topic, ``{model}`` empty, before any)."""
        known = sorted(set(self._topics.values()))
        return known or [self.topic("")]

    def _indexes(self, topic: bytes) -> list[tuple[str, BlockIndex]]:
        return [(medium, index) for (t, medium), index in self._index.items() if t == topic]

    def _index_of(self, topic: bytes, medium: str) -> BlockIndex:
        index = self._index.get((topic, medium))
        if index is None:
            index = self._index[(topic, medium)] = BlockIndex()
        return index

    def start(
        self,
        namespaces: list[str],
        kept: list[Kept],
        where: Callable[[ChunkKey], str | None],
        found: Sequence[tuple[ChunkKey, ChunkTokens]] = (),
    ) -> int:
        """A new epoch: ``AllBlocksCleared`` on the topic of each namespace the store
        holds at start (and the bare topic), so subscribers drop the last epoch's
        blocks; then a ``BlockStored`` for each ``kept`` chunk (:mod:`.keep`) that
        ``where`` (the store's fastest tier holding a key) finds, and for each chunk
        ``found`` with token ids in its record (the disk's scan after a stop that kept
        nothing) that is still stored and not announced yet.  Returns how many."""
        for namespace in ["", *namespaces, *(k.key.namespace for k in kept)]:
            self.topic(namespace)
        for topic in self.topics():
            self.publisher.publish(topic, [self.wire.all_cleared()])
        step = 4 * self.settings.block_size
        for key, held in kept:
            if len(held.packed) != step * len(held.hashes):
                continue  # kept under another events_block_size: its block hashes do not apply
            if len(held.packed) != 4 * self.chunk_ids(key.namespace):
                continue  # not one chunk's ids: never announced
            tier = where(key)
            if tier is None or key in self._where:
                continue
            topic, medium = self.topic(key.namespace), MEDIUM.get(tier, tier.upper())
            self._where[key] = (topic, medium)
            self.counters.restored_chunks += 1
            self._record(("restored", key, topic, held, medium))
        for key, tokens in found:
            tier = where(key)
            if tier is not None and key not in self._where:
                self.stored(key, tokens, tier)
                if key in self._where:  # counted as restored, not as a put's
                    self.counters.announced_chunks -= 1
                    self.counters.restored_chunks += 1
        return self.counters.restored_chunks

    def kept(self) -> Iterator[Kept]:
        """Every announced chunk with what the next start needs to announce it again."""
        self.publisher.flush()  # every recorded chunk is in its index
        for key, where in self._where.items():
            held = self._index[where].get(key) if where in self._index else None
            if held is not None:
                yield Kept(key, held)

    # -- Residency: record only ------------------------------------------------------
    def stored(self, key: ChunkKey, tokens: ChunkTokens, tier: str) -> None:
        try:
            if key in self._where:
                return  # (stored again in memory: the store tells ``moved``)
            size = len(tokens.packed)
            if size != 4 * self.chunk_ids(key.namespace) or size % (4 * self.settings.block_size):
                self.counters.skipped_chunks += 1  # a record's ids (up to 2**20), not a put's chunk
                return
            topic = self.topic(key.namespace)
            medium = MEDIUM.get(tier, tier.upper())
            self._where[key] = (topic, medium)
            self._unbuilt[key] = tokens
            self.counters.announced_chunks += 1
            self._record(("stored", key, topic, tokens, medium))
        except Exception:
            self._failed("stored")

    def announced(self, key: ChunkKey) -> bool:
        return key in self._where

    def medium(self, key: ChunkKey) -> str | None:
        """The medium ``key`` is announced with (None: not announced)."""
        return self._where[key][1] if key in self._where else None

    def remote_holds(self, key: ChunkKey) -> bool:
        return self.remote is not None and self.remote.holds(key)

    def tokens(self, key: ChunkKey) -> ChunkTokens | None:
        """The announced chunk ``key``'s token ids and parent key (None: not announced,
        or announced from a file kept by an older daemon, which has no parent key)."""
        where = self._where.get(key)
        if where is None:
            return None
        tokens = self._unbuilt.get(key)
        if tokens is not None:
            return tokens
        topic = where[0]
        for medium in (where[1], *MEDIUM.values(), REMOTE):  # its medium's, or the old one's before a move is built
            index = self._index.get((topic, medium))
            held = index.get(key) if index is not None else None
            if held is not None:
                return ChunkTokens(held.parent_key, held.packed) if held.parent_key else None
        return None

    def moved(self, key: ChunkKey, tier: str) -> None:
        """The fastest local tier holding the announced chunk ``key`` is now ``tier`` (the
        Redis tier: only Redis holds it, :mod:`.remote`)."""
        where = self._where.get(key)
        medium = REMOTE if tier in REMOTE_TIERS else MEDIUM.get(tier, tier.upper())
        if where is None or where[1] == medium:
            return
        self._where[key] = (where[0], medium)
        self.counters.moved_chunks += 1
        if medium == REMOTE and self.remote is not None:
            self.remote.moved(key)
        self._record(("moved", key, where[0], where[1], medium))

    def removed(self, key: ChunkKey) -> None:
        where = self._where.pop(key, None)
        if where is not None:
            self.counters.removed_chunks += 1
            self._record(("removed", key, *where))

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
        self._unbuilt.clear()
        for op in ops:
            try:
                getattr(self, f"_build_{op[0]}")(*op[1:])
            except Exception:
                self._failed(str(op[0]))

    def _stored_event(self, index: BlockIndex, key: ChunkKey, held: Held, medium: str) -> Event | None:
        """Record ``held`` in ``index``; the ``BlockStored`` of its blocks new there (None: none is)."""
        shared = index.add(key, held.hashes, held.parent, held.packed, held.parent_key)
        if shared == len(held.hashes):
            return None  # every block already announced (in this medium) by another chunk
        bs = self.settings.block_size
        parent = held.parent if shared == 0 else held.hashes[shared - 1]
        return self.wire.block_stored(
            held.hashes[shared:], parent, held.packed[shared * 4 * bs :], bs, *placement(medium)
        )

    def _build_restored(self, key: ChunkKey, topic: bytes, held: Held, medium: str) -> None:
        event = self._stored_event(self._index_of(topic, medium), key, held, medium)
        if event is not None:
            self.publisher.publish(topic, [event])

    def _build_stored(self, key: ChunkKey, topic: bytes, tokens: ChunkTokens, medium: str) -> None:
        hashes = block_hashes(key.digest, tokens.parent, tokens.packed, self.settings.block_size)
        held = Held(hashes, parent_hash(tokens.parent), tokens.packed, tokens.parent)  # type: ignore[arg-type]
        event = self._stored_event(self._index_of(topic, medium), key, held, medium)
        if event is not None:
            self.publisher.publish(topic, [event])

    def _build_moved(self, key: ChunkKey, topic: bytes, old: str, new: str) -> None:
        source = self._index_of(topic, old)
        held = source.get(key)
        if held is None:
            return
        events = []
        event = self._stored_event(self._index_of(topic, new), key, held, new)
        if event is not None:
            events.append(event)
        gone = source.remove(key)
        if gone:
            events.append(self.wire.block_removed(gone, *placement(old)))
        self.publisher.publish(topic, events)

    def _build_removed(self, key: ChunkKey, topic: bytes, medium: str) -> None:
        gone = self._index_of(topic, medium).remove(key)
        if gone:
            self.publisher.publish(topic, [self.wire.block_removed(gone, *placement(medium))])

    def _build_cleared(self, namespace: str | None) -> None:
        if namespace is None:
            for topic in self.topics():
                for _, index in self._indexes(topic):
                    index.clear()
                self.publisher.publish(topic, [self.wire.all_cleared()])
            return
        topic = self.topic(namespace)
        indexes = self._indexes(topic)
        gone = [(medium, index.remove_namespace(namespace)) for medium, index in indexes]
        if not any(len(index) for _, index in indexes):
            self.publisher.publish(topic, [self.wire.all_cleared()])
        else:
            self.publisher.publish(topic, [self.wire.block_removed(h, *placement(m)) for m, h in gone if h])

    # -- snapshot ----------------------------------------------------------------------
    def residency(self, prefix: bytes = b"") -> tuple[int, list[tuple[bytes, str, list[Held], set[int]]]]:
        """The announced residency, consistent with the stream: everything recorded is
        built and sent first, so it is the state after batch ``seq`` (returned with it)
        and a subscriber continues from ``seq + 1``.  Per (topic, medium) of topics
        starting with ``prefix``, its chunks in the order they were announced (a copy
        of references: what :class:`Held` keeps is never mutated; see
        :meth:`.blocks.BlockIndex.listing`)."""
        self.publisher.flush()
        seq = self.publisher.next_seq - 1
        out = [
            (topic, medium, *index.listing())
            for (topic, medium), index in self._index.items()
            if topic.startswith(prefix) and len(index)
        ]
        return seq, out

    def stats(self) -> dict[str, Any]:
        out = {
            "topics": len(set(self._topics.values())),
            "announced_chunks_now": len(self._where),
            "announced_blocks": sum(i.blocks for i in self._index.values()),
            "kept_bytes": sum(i.nbytes for i in self._index.values()),
            **dataclasses.asdict(self.counters),
            **self.publisher.stats(),
            **(self.snapshot_server.stats() if self.snapshot_server is not None else {}),
            **(self.remote.stats() if self.remote is not None else {}),
        }
        out["pending_events"] += len(self._ops)
        return out
