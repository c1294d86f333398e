"""The events endpoint: a PUB socket, an optional replay ROUTER, batching and sequence numbers.

- Events are queued per topic and sent as one ``KVEventBatch`` per topic when
  ``batch_max_events`` are pending or ``batch_interval_s`` after the first
  (whichever comes first), always from a callback of its own on the event
  loop: ``publish`` and ``wake`` only append or schedule, never block and
  never raise into a request.  ``prepare`` (the announcer's) runs first at each
  flush and turns what it recorded into events.
- Every batch gets the next sequence number (one counter per endpoint) and
  goes into the replay buffer before it is sent, so the sequence a subscriber
  can recover is gap-free.  An epoch's first number is its start time in
  microseconds (``first_seq``), not 0 as vLLM numbers them: a restarted
  daemon numbers past every batch of its previous epoch (unless the clock went
  back, or it published a million batches a second), so a subscriber that
  follows sequence numbers and knows no epoch (NVIDIA Dynamo's listener) takes
  the new epoch's batches, its ``AllBlocksCleared`` first, as the next ones
  rather than as batches it already has.
- The PUB socket sends without blocking: a subscriber past its high-water
  mark (``hwm``) loses batches (ZeroMQ drops them for that subscriber only,
  silently) and can ask the replay endpoint for them.  A send ZeroMQ refuses
  outright is dropped and counted (``dropped_batches``).
- Replay (vLLM's protocol): a request ``[b"", seq (8 bytes, big-endian)]``
  (a DEALER sends ``[b"", seq]``; a REQ socket adds the empty frame itself)
  is answered with every kept batch from ``seq`` on, each
  ``[b"", topic, seq, payload]``, then ``[b"", b"", END_SEQ, b""]``.
- A replay never copies the buffer: each batch goes out zero-copy (the
  buffer's own bytes), at most ``REPLAY_HWM`` messages are queued to one
  requester (``ROUTER_MANDATORY``: a full queue makes the replay wait, never
  drops), at most ``MAX_REPLAYS`` replays run at once (the next requests wait
  in the socket), and the bytes ZeroMQ still holds for all replays together
  stay under half the replay buffer's size (what it holds may have left the
  buffer meanwhile: that is the only memory replays add).  A requester that
  reads nothing for ``REPLAY_STALL_S`` loses the rest of its replay (no end
  marker; counted in ``abandoned_replays``).

- Heartbeat: with ``heartbeat_s`` > 0, when nothing was sent for that long,
  every topic gets an empty ``KVEventBatch`` (a sequence number of its own, in
  the replay buffer like any batch): a subscriber knows the publisher is
  alive and that it missed nothing.
- ``publisher_id``: a random id per daemon start (the epoch).  A new one means
  the subscriber must drop what it held from the old one; the first batches of
  each epoch are ``AllBlocksCleared`` (:meth:`.announcer.Announcer.start`).

Primitives: :class:`EventPublisher` (``bind``, ``publish``, ``wake``,
``flush``, ``serve_replay``, ``serve_heartbeat``, ``close``, ``stats``),
:class:`PublisherSettings` (what it is built from).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, cast

import zmq
import zmq.asyncio

from .replay import ReplayBuffer
from .wire import END_SEQ, Event, encode_batch, seq_bytes

logger = logging.getLogger(__name__)

REPLAY_YIELD_EVERY = 256
"""Batches sent to one replay request between two yields to the event loop."""
CLOSE_LINGER_MS = 200
"""At close, how long the last batches may take to leave (a stalled subscriber gets none)."""
REPLAY_HWM = 64
"""Messages queued to one replay requester; beyond, its replay waits (ROUTER_MANDATORY)."""
MAX_REPLAYS = 8
"""Replays served at once; further requests wait in the socket until one ends."""
REPLAY_STALL_S = 5.0
"""How long a replay waits for a requester that reads nothing before it gives up."""
REPLAY_WAIT_S = 0.005
"""The pause between two tries to queue a batch (the requester's queue, or all replays' bytes, full)."""


@dataclasses.dataclass
class PublisherCounters:
    events: int = 0
    batches: int = 0
    bytes: int = 0
    dropped_batches: int = 0
    replays: int = 0
    replayed_batches: int = 0
    bad_replay_requests: int = 0
    abandoned_replays: int = 0
    heartbeats: int = 0


@dataclasses.dataclass(frozen=True)
class PublisherSettings:
    """The events endpoint's keys (``events_*``: docs/events.md)."""

    endpoint: str
    replay_endpoint: str | None = None
    hwm: int = 1000
    replay_bytes: int = 64 << 20
    batch_max_events: int = 256
    batch_interval_s: float = 0.05
    data_parallel_rank: int = 0
    heartbeat_s: float = 0.0


class EventPublisher:
    """The PUB socket and replay ROUTER of ``settings`` (see the module).  ``prepare``
    runs at the start of every flush (the announcer builds its events then) and
    ``topics`` says where a heartbeat goes; the owner passes both in."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        settings: PublisherSettings,
        *,
        prepare: Callable[[], None] | None = None,
        topics: Callable[[], list[bytes]] = list,
    ):
        self.endpoint = settings.endpoint
        self.replay_endpoint = settings.replay_endpoint
        self.batch_max_events = settings.batch_max_events
        self.batch_interval_s = settings.batch_interval_s
        self.data_parallel_rank = settings.data_parallel_rank
        self.counters = PublisherCounters()
        self.buffer = ReplayBuffer(settings.replay_bytes)
        self.first_seq = time.time_ns() // 1000
        """The epoch's first sequence number: its start time in microseconds (module docstring)."""
        self.next_seq = self.first_seq
        self.heartbeat_s = settings.heartbeat_s
        self.publisher_id = uuid.uuid4().hex
        """This daemon's epoch: new at every start."""
        self.started = time.time()
        self._last_sent = time.monotonic()
        self.topics = topics
        """The topics a heartbeat goes to (the announcer's)."""
        self._pending: dict[bytes, list[Event]] = {}
        self._pending_events = 0
        self._timer: asyncio.TimerHandle | None = None
        self._soon: asyncio.Handle | None = None
        self._flushing = False
        self.prepare = prepare
        """Called at the start of every flush (the announcer builds its events then)."""
        # A plain (blocking-API) socket over the same ZeroMQ context: sends with
        # NOBLOCK complete at once, without a future per batch.
        self._sync: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(context.underlying)
        self._pub: zmq.Socket[bytes] = self._sync.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, settings.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_cap = max(1, settings.replay_bytes // 2)
        """Bytes of batches ZeroMQ may hold for all replays together."""
        self._in_flight: list[tuple[zmq.MessageTracker, int]] = []
        self._in_flight_bytes = 0
        if settings.replay_endpoint is not None:
            self._replay = context.socket(zmq.ROUTER)
            # A small queue per requester; a full one is EAGAIN (not a silent drop).
            self._replay.setsockopt(zmq.SNDHWM, REPLAY_HWM)
            self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._replay.setsockopt(zmq.LINGER, 0)

    def bind(self) -> None:
        """Bind both endpoints (a bad or taken address raises zmq.ZMQError)."""
        self._pub.bind(self.endpoint)
        if self._replay is not None and self.replay_endpoint is not None:
            self._replay.bind(self.replay_endpoint)

    # -- publishing ----------------------------------------------------------------
    def publish(self, topic: bytes, events: list[Event]) -> None:
        """Queue ``events`` for ``topic``; sent within ``batch_interval_s``."""
        if not events:
            return
        self._pending.setdefault(topic, []).extend(events)
        self._pending_events += len(events)
        self.wake(self._pending_events)

    def wake(self, pending: int) -> None:
        """``pending`` events wait (queued here or recorded by ``prepare``'s owner):
        flush at the next turn of the loop when they fill a batch, else after
        ``batch_interval_s``."""
        if self._flushing:
            return
        # (it runs for every event recorded: the loop is looked up only to schedule)
        if pending >= self.batch_max_events:
            if self._soon is None:
                self._soon = asyncio.get_running_loop().call_soon(self.flush)
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.batch_interval_s, self.flush)

    def flush(self) -> None:
        """Send what is pending now, one batch per topic (at most ``batch_max_events`` each)."""
        for handle in (self._timer, self._soon):
            if handle is not None:
                handle.cancel()
        self._timer = self._soon = None
        if self.prepare is not None:
            self._flushing = True
            try:
                self.prepare()
            finally:
                self._flushing = False
        pending, self._pending, self._pending_events = self._pending, {}, 0
        ts = time.time()
        for topic, events in pending.items():
            for start in range(0, len(events), self.batch_max_events):
                part = events[start : start + self.batch_max_events]
                self._send(topic, encode_batch(ts, part, self.data_parallel_rank), len(part))

    def _send(self, topic: bytes, payload: bytes, n_events: int) -> None:
        seq = self.next_seq
        self.next_seq += 1
        self.buffer.append(seq, topic, payload)
        self._last_sent = time.monotonic()
        c = self.counters
        try:
            self._pub.send_multipart([topic, seq_bytes(seq), payload], zmq.NOBLOCK)
        except zmq.ZMQError as err:
            c.dropped_batches += 1
            logger.debug("event batch %d not sent (%s); it stays in the replay buffer", seq, err)
            return
        c.batches += 1
        c.events += n_events
        c.bytes += len(payload)

    # -- heartbeat -------------------------------------------------------------------
    async def serve_heartbeat(self) -> None:
        """Send a heartbeat batch on every topic when nothing was sent for ``heartbeat_s``
        (returns at once when heartbeats are off)."""
        if self.heartbeat_s <= 0:
            return
        while True:
            await asyncio.sleep(max(0.0, self._last_sent + self.heartbeat_s - time.monotonic()))
            if time.monotonic() - self._last_sent >= self.heartbeat_s:
                self.heartbeat()

    def heartbeat(self) -> None:
        """An empty batch on every topic (each with its own sequence number)."""
        self.flush()
        payload = encode_batch(time.time(), [], self.data_parallel_rank)
        for topic in self.topics():
            self._send(topic, payload, 0)
            self.counters.heartbeats += 1

    # -- replay ----------------------------------------------------------------------
    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled (returns at once without a replay endpoint)."""
        sock = self._replay
        if sock is None:
            return
        slots = asyncio.Semaphore(MAX_REPLAYS)
        running: set[asyncio.Task[None]] = set()
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                    self.counters.bad_replay_requests += 1
                    logger.debug("ignoring a malformed replay request (%d frames)", len(frames))
                    continue
                identity, start = frames[0], int.from_bytes(frames[2], "big")
                self.counters.replays += 1
                await slots.acquire()
                task = asyncio.get_running_loop().create_task(self._replay_to(sock, identity, start))
                running.add(task)
                task.add_done_callback(running.discard)
                task.add_done_callback(lambda _: slots.release())
        finally:
            for task in list(running):
                task.cancel()

    async def _replay_to(self, sock: zmq.asyncio.Socket, identity: bytes, start: int) -> None:
        """One replay: every kept batch from ``start`` on, then the end marker."""
        for i, (seq, topic, payload) in enumerate(self.buffer.since(start)):
            if not await self._queue(sock, [identity, b"", topic, seq_bytes(seq)], payload):
                self.counters.abandoned_replays += 1
                return
            self.counters.replayed_batches += 1
            if (i + 1) % REPLAY_YIELD_EVERY == 0:
                await asyncio.sleep(0)
        if not await self._queue(sock, [identity, b"", b"", END_SEQ], b""):
            self.counters.abandoned_replays += 1

    async def _queue(self, sock: zmq.asyncio.Socket, head: list[bytes], payload: bytes) -> bool:
        """Queue one replay message, its payload zero-copy; waits while the requester's
        queue or all replays' bytes are full; False: the requester is gone or stalled."""
        stall = time.monotonic() + REPLAY_STALL_S
        while True:
            if self._in_flight_bytes + len(payload) <= self._replay_cap or self._settle(len(payload)):
                frame = zmq.Frame(payload, copy=False, track=True)
                try:
                    # NOBLOCK: zmq.asyncio sends at once and returns a done future.
                    cast("asyncio.Future[Any]", sock.send_multipart([*head, frame], zmq.NOBLOCK)).result()
                except zmq.Again:
                    pass  # the requester's queue is full: it reads slowly, or not at all
                except zmq.ZMQError as err:
                    logger.debug("replay to a requester that is gone: %s", err)
                    return False
                else:
                    self._in_flight.append((frame.tracker, len(payload)))
                    self._in_flight_bytes += len(payload)
                    return True
            if time.monotonic() > stall:
                logger.debug("replay abandoned: the requester read nothing for %.0f s", REPLAY_STALL_S)
                return False
            await asyncio.sleep(REPLAY_WAIT_S)

    def _settle(self, more: int) -> bool:
        """Forget the replay messages ZeroMQ is done with; True if ``more`` bytes now fit
        (always for a first message: one batch larger than the cap still goes)."""
        self._in_flight = [(t, n) for t, n in self._in_flight if not t.done]
        self._in_flight_bytes = sum(n for _, n in self._in_flight)
        return not self._in_flight or self._in_flight_bytes + more <= self._replay_cap

    def close(self) -> None:
        """Send what is pending, then close the sockets."""
        try:
            self.flush()
        except Exception:  # closing anyway
            logger.exception("last event batch not sent")
        self._pub.close(linger=CLOSE_LINGER_MS)  # the last batch still goes to subscribers that read
        if self._replay is not None:
            self._replay.close(linger=0)

    def stats(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "publisher_id": self.publisher_id,
            "replay_endpoint": self.replay_endpoint,
            "first_seq": self.first_seq,
            "next_seq": self.next_seq,
            "pending_events": self._pending_events,
            "replay_buffered_batches": len(self.buffer),
            "replay_buffered_bytes": self.buffer.nbytes,
            "replay_in_flight_bytes": self._in_flight_bytes,
            **dataclasses.asdict(self.counters),
        }
