"""The snapshot endpoint: a router (re)building its index asks for the node's whole
announced residency, then follows the live stream from the snapshot's sequence on.

Follows the recovery contract of vLLM PR #57789 (a separate snapshot endpoint,
a publisher id per lifetime, a snapshot with an exact live-stream resume
point); that PR's frames are not published in a vLLM release, so the frames
below are ours (docs/events.md, "Snapshot"):

- request (a DEALER; a REQ socket adds the empty frame itself):
  ``[b"", topic_prefix]`` (``b""``: every topic);
- answer: a header ``[b"", b"", seq, meta]`` (``seq`` 8 bytes big-endian: the
  last batch the snapshot includes; ``meta`` msgpack ``{"publisher_id",
  "seq", "started", "block_size", "chunks"}``), then the snapshot's
  batches ``[b"", topic, seq, payload]`` (``payload`` a ``KVEventBatch`` of
  ``BlockStored`` events, decodable by vLLM's decoder: every announced block
  once per topic and medium, chained by ``parent_block_hash`` as the live
  stream chained them), then the replay endpoint's end marker
  ``[b"", b"", END_SEQ, b""]``.

Consistency: the residency is taken on the event loop right after a flush of
everything recorded (:meth:`.announcer.Announcer.residency`), so it is the
state after batch ``seq``: snapshot + live batches ``seq + 1, ...`` (or a
replay from ``seq + 1``) is gap-free.  Encoding runs afterwards, a slice of
chunks at a time, each slice sent before the next is encoded, yielding to the
event loop between slices (what it reads is never mutated), so puts are served
meanwhile and the answer never holds the whole snapshot in memory.  One
snapshot at a time (the next requests wait in the socket), so each is bounded:
a requester that reads nothing for ``STALL_S``, or whose snapshot is not sent
whole within ``timeout_s`` (``events_snapshot_timeout_s``; a reader that
takes one batch every few seconds), loses the rest (no end marker; counted in
``snapshots_abandoned``, the second also in ``snapshots_timed_out``) and the
next request is answered.  What ZeroMQ queued for it already (at most
``SNDHWM`` messages) stays queued until it reads or goes.

Primitives: :class:`SnapshotServer` (``bind``, ``serve``, ``close``), :class:`SnapshotSettings`
(what the announcer builds it from), :func:`snapshot_events`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Protocol, cast

import msgpack
import zmq
import zmq.asyncio

from .blocks import Held
from .publisher import EventPublisher
from .remote import placement
from .wire import END_SEQ, Event, Wire, encode_batch, seq_bytes

logger = logging.getLogger(__name__)

STALL_S = 5.0
"""How long a snapshot waits for a requester that reads nothing before it gives up."""
TIMEOUT_S = 60.0
"""The default total time one snapshot may take (``events_snapshot_timeout_s``)."""
ENCODE_SLICE = 512
"""Chunks encoded between two yields to the event loop."""
MAX_PREFIX = 1024
"""The longest topic prefix a request may name."""


@dataclasses.dataclass(frozen=True)
class SnapshotSettings:
    """``events_snapshot_endpoint`` and ``events_snapshot_timeout_s``."""

    endpoint: str
    timeout_s: float = TIMEOUT_S


class BlockSized(Protocol):
    @property
    def block_size(self) -> int: ...


class SnapshotSource(Protocol):
    """What a snapshot reads of the announcer (:class:`.announcer.Announcer` is one, and
    builds this endpoint with itself: this module does not import it)."""

    @property
    def publisher(self) -> EventPublisher: ...
    @property
    def settings(self) -> BlockSized: ...
    @property
    def wire(self) -> Wire: ...

    def residency(self, prefix: bytes = b"") -> tuple[int, list[tuple[bytes, str, list[Held], set[int]]]]: ...


class SnapshotServer:
    """The snapshot endpoint of ``announcer``; each snapshot takes at most ``timeout_s``."""

    def __init__(
        self, context: zmq.asyncio.Context, endpoint: str, announcer: SnapshotSource, timeout_s: float = TIMEOUT_S
    ):
        self.endpoint = endpoint
        self.announcer = announcer
        self.timeout_s = timeout_s
        self.snapshots = 0
        self.bad_requests = 0
        self.abandoned = 0
        self.timed_out = 0
        self.last_chunks = 0
        self.last_bytes = 0
        self._sock = context.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, 64)
        self._sock.setsockopt(zmq.LINGER, 0)

    def bind(self) -> None:
        self._sock.bind(self.endpoint)

    async def serve(self) -> None:
        """Answer snapshot requests, one at a time, until cancelled."""
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) > MAX_PREFIX:
                self.bad_requests += 1
                logger.debug("ignoring a malformed snapshot request (%d frames)", len(frames))
                continue
            try:
                await self._answer(frames[0], frames[2])
            except zmq.ZMQError as err:
                self.abandoned += 1
                logger.debug("snapshot to a requester that is gone: %s", err)

    async def _answer(self, identity: bytes, prefix: bytes) -> None:
        # The endpoint's only slot: a reader that keeps taking a batch now and then would
        # hold it for as long as it likes without a total deadline.
        deadline = time.monotonic() + self.timeout_s
        announcer = self.announcer
        seq, residency = announcer.residency(prefix)  # consistent: taken between two batches
        meta: dict[str, Any] = {
            "publisher_id": announcer.publisher.publisher_id,
            "seq": seq,
            "started": announcer.publisher.started,
            "block_size": announcer.settings.block_size,
            "chunks": sum(len(held) for _, _, held, _ in residency),
        }
        at = seq_bytes(max(seq, 0))
        if not await self._send([identity, b"", b"", at, msgpack.packb(meta)], deadline):
            return
        # Encoded a slice at a time and sent as it goes: what the answer holds at once is
        # one slice plus what ZeroMQ queues to the requester (SNDHWM messages).
        max_events = announcer.publisher.batch_max_events
        block_size = announcer.settings.block_size
        ts = time.time()
        nbytes = 0
        for topic, medium, held, multi in residency:
            seen: set[int] = set()  # the blocks this snapshot announced so far, for this topic and medium
            for start in range(0, len(held), ENCODE_SLICE):
                events = snapshot_events(
                    announcer.wire, block_size, seen, held[start : start + ENCODE_SLICE], multi, medium
                )
                for i in range(0, len(events), max_events):
                    payload = encode_batch(ts, events[i : i + max_events])
                    nbytes += len(payload)
                    if not await self._send([identity, b"", topic, at, payload], deadline):
                        return
                await asyncio.sleep(0)
        if await self._send([identity, b"", b"", END_SEQ, b""], deadline):
            self.snapshots += 1
            self.last_chunks = meta["chunks"]
            self.last_bytes = nbytes

    async def _send(self, frames: list[bytes], deadline: float) -> bool:
        """Send one message of a snapshot; False: the snapshot is given up (the requester
        read nothing for ``STALL_S``, or the snapshot's ``deadline`` passed)."""
        now = time.monotonic()
        stall = now + STALL_S
        while True:
            if now > deadline:
                self.abandoned += 1
                self.timed_out += 1
                logger.warning(
                    "snapshot abandoned: not read whole within events_snapshot_timeout_s (%.1f s)", self.timeout_s
                )
                return False
            try:
                # NOBLOCK: zmq.asyncio sends at once and returns a done future.
                cast("asyncio.Future[Any]", self._sock.send_multipart(frames, zmq.NOBLOCK)).result()
                return True
            except zmq.Again:
                if now > stall:
                    self.abandoned += 1
                    logger.debug("snapshot abandoned: the requester read nothing for %.0f s", STALL_S)
                    return False
                await asyncio.sleep(0.005)
                now = time.monotonic()

    def close(self) -> None:
        self._sock.close(linger=0)

    def stats(self) -> dict[str, Any]:
        return {
            "snapshots": self.snapshots,
            "snapshot_bad_requests": self.bad_requests,
            "snapshots_abandoned": self.abandoned,
            "snapshots_timed_out": self.timed_out,
            "snapshot_last_chunks": self.last_chunks,
            "snapshot_last_bytes": self.last_bytes,
        }


def snapshot_events(
    wire: Wire, block_size: int, seen: set[int], chunks: list[Held], multi: set[int], medium: str
) -> list[Event]:
    """``BlockStored`` events that announce ``chunks`` (of one topic and medium, from
    :meth:`.announcer.Announcer.residency`, with the blocks ``multi`` more than one of
    them holds) to a subscriber that knows only the blocks in ``seen`` (updated here
    with the chunks that may share blocks): each block once, chained as the live
    stream chained it."""
    step = 4 * block_size
    events = []
    for held in chunks:
        hashes = held.hashes
        shared = 0
        if hashes[0] in multi:
            for h in hashes:
                if h not in seen:
                    break
                shared += 1
            if shared == len(hashes):
                continue
            seen.update(hashes)
        parent = held.parent if shared == 0 else hashes[shared - 1]
        events.append(
            wire.block_stored(hashes[shared:], parent, held.packed[shared * step :], block_size, *placement(medium))
        )
    return events
