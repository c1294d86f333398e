"""The remote tier: a store shared by every node, written behind, read through.
It runs on one of two links (:mod:`.links`): Redis (the default) or Mooncake Store.

- Redis URLs: ``redis://``, ``rediss://`` (TLS), ``unix:///path.sock`` for one
  server; ``redis+cluster://`` / ``rediss+cluster://`` for Redis Cluster (any
  node's address; the rest are discovered).  User and password come from the
  URL or from ``remote_username`` / ``remote_password`` (e.g. the env var
  ``LMCACHE_REMOTE_PASSWORD``), never logged.  Mooncake: ``mooncake://MASTER:PORT``
  and the ``mooncake_*`` keys (:mod:`.mooncake`).
- Keys: ``<prefix><16 hex of SHA-256(namespace)>:<64 hex key>``; values are
  :mod:`.chunkfile` records (header with namespace, key, length, CRC32C, then
  the payload), so a damaged or foreign value is a miss, never wrong bytes.
  Optional TTL (``remote_ttl_s``, Redis only).
- Writes: every chunk stored in memory is queued (:mod:`.queue`,
  bounded by bytes; full -> drop and count), its record (checksum and copy)
  built off the event loop (:mod:`.offload`), and written by a background
  task in batches sized to what the link sends within half of
  ``remote_timeout_s``; a request never waits.  A write leaves the queue only once the
  store acknowledged it: one that failed is written again when the store is back, and
  writes queued while it is down wait (up to the bound) instead of being dropped.
- Removals: delete and clear take the chunks out of the queue too (a queued
  write must not re-create them), and what the store could not be told (it was
  down, or a write may still land) is sent before any later write.
- Reads: only on a memory and disk miss; the misses of one batch are one
  round trip (a pipeline of GETs; on a cluster split per node by redis-py),
  each reply bounded by ``remote_timeout_s``; records are verified off the loop.
- KV events: ``listener`` (:class:`..base.RemoteListener`, heard on the tier's
  :class:`..base.TierLinks`) is told what the store
  acknowledged (the writer), what reads and EXISTS found or missed, deletes,
  clears and outages, so that a chunk that leaves the local tiers can be
  announced as held remotely (docs/events.md, "Media and locality").
- Restarts: with ``state_path`` (in the private state directory,
  :mod:`..statefiles`), a clean stop saves the removals and the keys
  of the writes the store was not yet told about (:mod:`.pending`); the next
  start sends the removals before anything else (reads of the keys they cover
  are misses meanwhile) and re-queues the writes of chunks it still holds
  (:meth:`requeue`, after a warm restart), logging what is dropped.
- Failure: any error of the store marks the link down (logged once, ``up`` metric
  0); while down, reads are misses.  Not an outage: a write batch of several writes
  that timed out (the next ones are smaller), an error the store answers for one
  key of a read (a miss).  A background probe with exponential backoff and jitter
  brings it back.  The writer and the probe are supervised (:mod:`..supervisor`).

:class:`RemoteTier` is a front that holds its parts: the link (``link``, a
:class:`.links.RemoteLink`: the client, the key names, the up/down state and its
reconnect, which calls the tier back when it goes down); the write queue (``queue``,
:class:`.queue.WriteQueue`); the writes (``writer``, :class:`.writer.RemoteWriter`,
on the link and the queue); what a stop owed the store, carried to the next start
(``carryover``, :class:`.carryover.RemoteCarryover`, on the link and the queue).
The tier itself holds the lifecycle, the reads and the removals.

Primitives: ``open``, ``get``, ``get_many``, ``enqueue``, ``requeue``, ``exists_many``, ``value_sizes``, ``deleting``,
``delete``, ``clear``, ``flush``, ``stats``, ``close``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lmcache_client.protocol import PutStatus

from ...config import redact
from ...supervisor import Supervisor
from ..base import Chunk, ChunkKey, RemoteListener, TierLinks
from ..chunkfile import CorruptRecord, decode_record
from ..offload import Offload
from ..statefiles import StateDir
from .carryover import RemoteCarryover
from .link import COMMAND_RETRIES as COMMAND_RETRIES  # re-exported
from .link import RedisLink
from .link import RemoteCounters as RemoteCounters  # re-exported
from .links import LinkFactory
from .queue import WriteQueue
from .writer import BATCH_WRITES as BATCH_WRITES  # re-exported
from .writer import POISON_FAILURES as POISON_FAILURES  # re-exported
from .writer import RemoteWriter

logger = logging.getLogger(__name__)


def state_path_for(state: StateDir | None) -> Path | None:
    """Where a daemon keeps what it owed the remote store at a clean stop: in its private
    state directory (:mod:`..statefiles`; never in the world-writable ``shm_dir``, where
    another user could plant a file that clears the shared store); None: not kept."""
    return None if state is None else state.file("redis-pending", ".json")


class RemoteTier:
    """The remote tier's front: builds its link (Redis or Mooncake: ``link`` makes it,
    given what to call when it goes down) and its parts (the write queue, the writer,
    the carryover); does the reads and the removals itself.  :meth:`redis` builds
    one on a Redis link."""

    def __init__(
        self,
        link: LinkFactory,
        *,
        ttl_s: float = 0.0,
        max_queue_bytes: int = 256 << 20,
        offload: Offload | None = None,
        state_path: Path | None = None,
        links: TierLinks | None = None,
    ):
        self.link = link(on_down=self._down)
        self.name = self.link.name  # the tiers' protocol (roles.Uplink) reads it as an attribute
        self.ttl_ms = int(ttl_s * 1000) or None
        self.max_queue_bytes = max_queue_bytes
        self._offload = offload if offload is not None else Offload(1, f"lmcache-{self.name}")
        self._own_offload = offload is None
        self.queue = WriteQueue(max_queue_bytes)
        self.links = links if links is not None else TierLinks()  # token ids for records (KV events)
        self._stopped = False
        self._tasks: list[asyncio.Task[None]] = []
        self.writer = RemoteWriter(self.link, self.queue, self._offload, self.links, self._listener, ttl_ms=self.ttl_ms)
        self.carryover = RemoteCarryover(self.link, self.queue, state_path)

    @classmethod
    def redis(
        cls,
        url: str,
        *,
        key_prefix: str = "lmcache:",
        timeout_s: float = 2.0,
        username: str | None = None,
        password: str | None = None,
        max_backoff_s: float = 2.0,
        supervisor: Supervisor | None = None,
        ttl_s: float = 0.0,
        max_queue_bytes: int = 256 << 20,
        offload: Offload | None = None,
        state_path: Path | None = None,
        links: TierLinks | None = None,
    ) -> RemoteTier:
        """The tier on a Redis link."""
        link = functools.partial(
            RedisLink, url, key_prefix=key_prefix, timeout_s=timeout_s, username=username, password=password,
            max_backoff_s=max_backoff_s, supervisor=supervisor,
        )  # fmt: skip
        return cls(
            link, ttl_s=ttl_s, max_queue_bytes=max_queue_bytes, offload=offload, state_path=state_path, links=links
        )

    # -- the link's state, read by the store, the metrics and the tests --------------
    @property
    def up(self) -> bool:
        return self.link.state.up

    @property
    def counters(self) -> RemoteCounters:
        return self.link.state.counters

    @property
    def url(self) -> str:
        return self.link.url

    @property
    def timeout_s(self) -> float:
        return self.link.timeout_s

    @property
    def batch_bytes(self) -> int:
        return self.writer.batch_bytes

    def remote_key(self, key: ChunkKey) -> Any:
        return self.link.remote_key(key)

    # -- writes (:mod:`.writer`) and what a stop owed (:mod:`.carryover`) --------------
    def accepts(self, size: int) -> bool:
        return self.writer.accepts(size)

    def enqueue(self, key: ChunkKey, data: Any, release: Callable[[], None] | None = None) -> bool:
        return self.writer.enqueue(key, data, release)

    async def put(self, key: ChunkKey, data: Any, parent: ChunkKey | None = None) -> PutStatus:
        return await self.writer.put(key, data, parent)

    def requeue(self, enqueue: Callable[[ChunkKey], bool]) -> None:
        self.carryover.requeue(enqueue)

    # -- lifecycle -----------------------------------------------------------------
    async def open(self) -> None:
        """Connect (without failing the start if Redis is down), take over what the
        last stop left pending (``state_path``) and start the writer."""
        self.carryover.load()
        await self.link.connect()
        self._tasks.append(self.link.state.supervisor.spawn(f"{self.name}_writer", self.writer.write_loop))

    async def flush(self, timeout_s: float) -> bool:
        """Wait until queued writes and removals reached Redis (True) or the timeout passes."""
        deadline = time.monotonic() + timeout_s
        while not self._drained() and self.up and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self._drained()

    def _drained(self) -> bool:
        return self.queue.idle() and self.writer.idle()

    async def close(self) -> None:
        self._stopped = True  # a stop is no outage: nothing more to announce
        tasks = [t for t in [*self._tasks, self.link.state.probing, *self.writer.building] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.carryover.save()  # after the writer put back what it had taken
        self.queue.release_all()  # the pool leases of writes sent from the pool
        if self._own_offload:
            self._offload.close()
        await self.link.aclose()

    def _down(self) -> None:
        """The link went down (its ``on_down``): nothing in Redis can be served now."""
        if self.listener is not None:
            self.listener.down()

    # -- reads ---------------------------------------------------------------------
    def peek(self, key: ChunkKey) -> bool:
        return False  # Redis cannot be asked synchronously: see exists_many

    def peek_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [False] * len(keys)

    async def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """One round trip for many keys; all False while the uplink is down."""
        if not keys or not self.up:
            return [False] * len(keys)
        if self.queue.pending_removals:
            hidden = [self.queue.removing(k) for k in keys]
            if any(hidden):
                found = await self.exists_many([k for k, h in zip(keys, hidden) if not h]) if not all(hidden) else []
                it = iter(found)
                return [False if h else next(it) for h in hidden]
        started = time.monotonic()
        try:
            found = await self.link.exists([self.remote_key(k) for k in keys])
        except Exception as err:
            self.link.state.counters.read_errors += 1
            self.link.state.failed("exists", err)
            return [False] * len(keys)
        finally:
            self.link.state.counters.timed("exists", started)
        if not isinstance(found, list) or len(found) != len(keys) or not all(isinstance(n, int) for n in found):
            # A server that speaks RESP but not Redis: answer misses, count it.
            self.link.state.counters.read_errors += 1
            logger.warning("%s: EXISTS answered %.80r; treated as misses", self.link.label, found)
            return [False] * len(keys)
        if self.listener is not None:
            self.listener.gone([k for k, n in zip(keys, found) if not n])
        return [bool(n) for n in found]

    async def value_sizes(self, keys: Sequence[ChunkKey]) -> list[int]:
        """The size in bytes of each key's record (payload plus its header; 0: not
        stored), in one round trip (STRLEN); all 0 while the uplink is down or when
        the round trip fails.  A prefetch sizes its budget with it."""
        if not keys or not self.up:
            return [0] * len(keys)
        hidden = [self.queue.removing(k) for k in keys] if self.queue.pending_removals else [False] * len(keys)
        asked = [k for k, h in zip(keys, hidden) if not h]  # removed here, not yet in Redis: a miss
        if not asked:
            return [0] * len(keys)
        started = time.monotonic()
        try:
            found = await self.link.sizes([self.remote_key(k) for k in asked])
        except Exception as err:
            self.link.state.counters.read_errors += 1
            self.link.state.failed("strlen", err)
            return [0] * len(keys)
        finally:
            self.link.state.counters.timed("sizes", started)
        if not isinstance(found, list) or len(found) != len(asked):
            self.link.state.counters.read_errors += 1
            logger.warning("%s: STRLEN answered %.80r; treated as misses", self.link.label, found)
            return [0] * len(keys)
        # An error Redis answers for one key (a value of another type): a miss.
        sizes = iter(n if isinstance(n, int) and n > 0 else 0 for n in found)
        return [0 if h else next(sizes) for h in hidden]

    async def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return await self.exists_many(keys)

    async def get(self, key: ChunkKey) -> Chunk | None:
        [chunk] = await self.get_many([key])
        return chunk

    async def get_many(self, keys: Sequence[ChunkKey]) -> list[Chunk | None]:
        """Every key in one round trip: a pipeline of GETs, sent in one write (on a
        cluster redis-py sends one per node: the keys lie in different slots).

        Each reply is bounded by ``timeout_s`` on its own (redis-py's socket timeout
        covers one reply), the batch by ``timeout_s`` per key: a batch of big values
        on a slow link takes as long as its GETs one by one would, where one MGET
        reply holding all of them had to arrive within ``timeout_s`` and a slow
        but working link was taken for an outage.  The records are verified off the
        loop.  A miss per key while the uplink is down or when the round trip fails;
        a key Redis answers with an error (a value of another type) is a miss too,
        and left alone."""
        if not keys:
            return []
        if not self.up:
            self.link.state.counters.misses += len(keys)
            return [None] * len(keys)
        if self.queue.pending_removals and any(self.queue.removing(k) for k in keys):
            # Removed here but not yet in Redis (it was down, or the daemon restarted): a miss.
            hidden = [self.queue.removing(k) for k in keys]
            self.link.state.counters.misses += sum(hidden)
            rest = [k for k, h in zip(keys, hidden) if not h]
            found = iter(await self.get_many(rest) if rest else [])
            return [None if h else next(found) for h in hidden]
        rkeys = [self.remote_key(k) for k in keys]
        started = time.monotonic()
        try:
            values = await self.link.read(rkeys)
        except Exception as err:
            self.link.state.counters.read_errors += 1
            self.link.state.failed("get", err)
            self.link.state.counters.misses += len(keys)
            return [None] * len(keys)
        finally:
            self.link.state.counters.timed("read", started)
        if not isinstance(values, list) or len(values) != len(keys):
            # A server that speaks RESP but not Redis: answer misses, count it.
            self.link.state.counters.read_errors += 1
            self.link.state.counters.misses += len(keys)
            logger.warning("%s: a batch of %d GETs answered %.80r; treated as misses", self.link.label, len(keys),
                           values)  # fmt: skip
            return [None] * len(keys)
        refused = [v for v in values if isinstance(v, Exception)]
        if refused:
            self.link.state.counters.read_errors += 1
            self.link.state.counters.misses += len(refused)
            logger.warning("%s: %d of %d GETs answered an error (%s); treated as misses",
                           self.link.label, len(refused), len(keys), refused[0])  # fmt: skip
        chunks = list(await asyncio.gather(*(self._decoded(k, rk, v) for k, rk, v in zip(keys, rkeys, values))))
        if self.listener is not None:  # what Redis holds (a key it answered with an error: unknown)
            self.listener.found([k for k, c in zip(keys, chunks) if c is not None])
            missed = [k for k, v, c in zip(keys, values, chunks) if c is None and not isinstance(v, Exception)]
            self.listener.gone(missed)
        return chunks

    async def _decoded(self, key: ChunkKey, rkey: Any, value: Any) -> Chunk | None:
        """The chunk in ``value`` (None: a miss), verified; a damaged value is deleted.
        An error Redis answered for the key is a miss get_many counted already."""
        if isinstance(value, Exception):
            return None
        if value is None or (isinstance(value, (bytes, bytearray, memoryview)) and not len(value)):
            self.link.state.counters.misses += 1
            return None
        try:
            payload, tokens = await self._offload.run(decode_record, value, key.namespace, key.digest)
        except CorruptRecord as err:
            logger.warning("%s: value %r is damaged (%s); deleted, answered as a miss", self.link.label, rkey, err)
            self.link.state.counters.corrupt += 1
            self.link.state.counters.misses += 1
            await self.link.drop(rkey)
            return None
        self.link.state.counters.hits += 1
        chunk = Chunk(payload, self.name)
        chunk.tokens = tokens
        return chunk

    # -- removal -------------------------------------------------------------------
    @property
    def listener(self) -> RemoteListener | None:
        """Told what Redis holds (KV events): the listener heard on ``links``, until the tier stops."""
        return self._listener()

    def _listener(self) -> RemoteListener | None:
        return None if self._stopped else self.links.remote

    def deleting(self, keys: Sequence[ChunkKey]) -> None:
        """``keys`` are about to be deleted from every tier: the listener forgets them
        first (their leaving memory then is no move to Redis)."""
        if self.listener is not None:
            self.listener.gone(keys)

    async def delete(self, key: ChunkKey) -> bool:
        """Remove ``key`` from Redis and from the write queue (while down: once it is back)."""
        if self.listener is not None:
            self.listener.gone([key])
        queued = self.queue.cancel(key)
        if not self.up:
            self.queue.remember_delete(key)
            self.link.state.wake.set()
            return queued
        started = time.monotonic()
        try:
            removed = await self.link.remove([key])
        except Exception as err:
            self.queue.remember_delete(key)
            self.link.state.failed("delete", err)
            return queued
        finally:
            self.link.state.counters.timed("remove", started)
        return bool(removed) or queued

    async def clear(self, namespace: str | None) -> int:
        """Remove this daemon's keys (all under the prefix, or one namespace's) from
        Redis and from the write queue (while down: from Redis once it is back)."""
        if self.listener is not None:
            self.listener.cleared(namespace)
        queued = self.queue.cancel_namespace(namespace)
        if not self.up:
            self.queue.remember_clear(namespace)
            self.link.state.wake.set()
            return queued
        started = time.monotonic()
        try:
            return max(await self.link.clear(namespace), queued)
        except Exception as err:
            self.queue.remember_clear(namespace)
            self.link.state.failed("clear", err)
            return queued
        finally:
            self.link.state.counters.timed("clear", started)

    def keys(self) -> list[ChunkKey]:
        return []  # not enumerable cheaply; clear reports what it removed locally

    def namespaces(self) -> dict[str, tuple[int, int]]:
        return {}

    def stats(self) -> dict[str, Any]:
        return {
            "up": self.up,
            "url": redact(self.url),
            "engine": self.name,
            "queued_writes": len(self.queue),
            "queued_bytes": self.queue.nbytes,
            "pending_removals": self.queue.pending_removals + self.writer.removing,
            "lost_deletes": self.queue.lost_deletes,
            "ttl_s": (self.ttl_ms or 0) / 1000,
            **dataclasses.asdict(self.counters),
        }
