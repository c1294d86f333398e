"""The Redis uplink: a tier shared by every node, written behind, read through.

- URLs: ``redis://``, ``rediss://`` (TLS), ``unix:///path.sock`` for one
  server; ``redis+cluster://`` / ``rediss+cluster://`` for Redis Cluster (any
  node's address; the rest are discovered).  User and password come from the
  URL or from ``remote_username`` / ``remote_password`` (e.g. the env var
  ``LMCACHE_REMOTE_PASSWORD``), never logged.
- Keys: ``<prefix><16 hex of SHA-256(namespace)>:<64 hex key>``; values are
  :mod:`.chunkfile` records (header with namespace, key, length, CRC32C, then
  the payload), so a damaged or foreign value is a miss, never wrong bytes.
  Optional TTL (``remote_ttl_s``).
- Writes: every chunk stored in memory is queued (bounded by bytes; full ->
  drop and count) and written by a background task; a request never waits.
- Reads: only on a memory and disk miss, bounded by ``remote_timeout_s``.
- Failure: any Redis error marks the uplink down (logged once, ``up`` metric
  0); while down, reads are misses and writes are dropped and counted; a
  background task pings with exponential backoff and resumes by itself.

Primitives: ``open``, ``get``, ``enqueue``, ``exists_many``, ``delete``,
``clear``, ``flush``, ``stats``, ``close``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import logging
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from lmcache_client.protocol import PutStatus

from ..config import redact
from .base import Chunk, ChunkKey
from .chunkfile import CorruptRecord, encode_header, parse_header, verify_payload

logger = logging.getLogger(__name__)

_ERRORS = (RedisError, OSError, TimeoutError, asyncio.TimeoutError)


@dataclasses.dataclass
class RemoteCounters:
    hits: int = 0
    misses: int = 0
    stores: int = 0
    dropped_writes: int = 0
    write_errors: int = 0
    read_errors: int = 0
    corrupt: int = 0
    reconnects: int = 0


class RedisTier:
    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "lmcache:",
        ttl_s: float = 0.0,
        timeout_s: float = 2.0,
        max_queue_bytes: int = 256 << 20,
        username: str | None = None,
        password: str | None = None,
        max_backoff_s: float = 10.0,
    ):
        self.url = url
        self.key_prefix = key_prefix
        self.ttl_ms = int(ttl_s * 1000) or None
        self.timeout_s = timeout_s
        self.max_queue_bytes = max_queue_bytes
        self.max_backoff_s = max_backoff_s
        self.counters = RemoteCounters()
        self.up = False
        self._client = self._connect(url, username, password)
        self._queue: collections.deque[tuple[ChunkKey, bytearray, int]] = collections.deque()
        self._queued_bytes = 0
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._reconnecting: asyncio.Task[None] | None = None
        self._writing = 0

    def _connect(self, url: str, username: str | None, password: str | None) -> Any:
        kwargs: dict[str, Any] = {
            "socket_timeout": self.timeout_s,
            "socket_connect_timeout": self.timeout_s,
            "decode_responses": False,
        }
        if username:
            kwargs["username"] = username
        if password:
            kwargs["password"] = password
        scheme = urllib.parse.urlsplit(url).scheme
        if scheme.endswith("+cluster"):
            plain = url.replace(scheme, scheme.removesuffix("+cluster"), 1)
            return RedisCluster.from_url(plain, **kwargs)
        return aioredis.Redis.from_url(url, **kwargs)

    def redis_key(self, key: ChunkKey) -> bytes:
        ns_tag = hashlib.sha256(key.namespace.encode()).hexdigest()[:16]
        return f"{self.key_prefix}{ns_tag}:{key.digest.hex()}".encode()

    # -- lifecycle -----------------------------------------------------------------
    async def open(self) -> None:
        """Connect (without failing the start if Redis is down) and start the writer."""
        try:
            await asyncio.wait_for(self._client.ping(), self.timeout_s)
            self.up = True
            logger.info("Redis uplink %s connected", redact(self.url))
        except _ERRORS as err:
            self._mark_down(err)
        self._tasks.append(asyncio.get_running_loop().create_task(self._write_loop()))

    def _mark_down(self, err: BaseException) -> None:
        if self.up or self._reconnecting is None:
            logger.warning("Redis uplink %s down (%s: %s); serving from memory and disk, retrying",
                           redact(self.url), type(err).__name__, err)  # fmt: skip
        self.up = False
        if self._reconnecting is None or self._reconnecting.done():
            self._reconnecting = asyncio.get_running_loop().create_task(self._reconnect_loop())

    async def _reconnect_loop(self) -> None:
        backoff = 0.2
        while not self.up:
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)
            try:
                await asyncio.wait_for(self._client.ping(), self.timeout_s)
            except _ERRORS:
                continue
            self.up = True
            self.counters.reconnects += 1
            logger.info("Redis uplink %s restored", redact(self.url))
            self._wake.set()

    async def flush(self, timeout_s: float) -> bool:
        """Wait until queued writes are written (True) or the timeout passes."""
        deadline = time.monotonic() + timeout_s
        while (self._queue or self._writing) and self.up and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return not self._queue and not self._writing

    async def close(self) -> None:
        for task in [*self._tasks, self._reconnecting]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*[t for t in [*self._tasks, self._reconnecting] if t], return_exceptions=True)
        try:
            await self._client.aclose()
        except _ERRORS:
            pass

    # -- writes --------------------------------------------------------------------
    def enqueue(self, key: ChunkKey, data: Any) -> bool:
        """Queue a chunk for Redis; False (counted) if the uplink is down or the queue full."""
        size = memoryview(data).nbytes
        if not self.up or self._queued_bytes + size > self.max_queue_bytes:
            self.counters.dropped_writes += 1
            return False
        header = encode_header(key.namespace, key.digest, data)
        value = bytearray(len(header) + size)
        value[: len(header)] = header
        value[len(header) :] = memoryview(data).cast("B")
        self._queue.append((key, value, size))
        self._queued_bytes += size
        self._wake.set()
        return True

    async def _write_loop(self) -> None:
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            key, value, size = self._queue.popleft()
            self._writing += 1
            try:
                if not self.up:
                    self.counters.dropped_writes += 1
                    continue
                # A memoryview goes out as its own chunk (redis-py's asyncio packer), uncopied.
                await self._client.set(self.redis_key(key), memoryview(value), px=self.ttl_ms)
                self.counters.stores += 1
            except _ERRORS as err:
                self.counters.write_errors += 1
                self.counters.dropped_writes += 1
                self._mark_down(err)
            finally:
                self._writing -= 1
                self._queued_bytes -= size

    async def put(self, key: ChunkKey, data: Any, parent: ChunkKey | None = None) -> PutStatus:
        return PutStatus.STORED if self.enqueue(key, data) else PutStatus.NO_SPACE

    # -- reads ---------------------------------------------------------------------
    def peek(self, key: ChunkKey) -> bool:
        return False  # Redis cannot be asked synchronously: see exists_many

    async def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """One round trip for many keys; all False while the uplink is down."""
        if not keys or not self.up:
            return [False] * len(keys)
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.exists(self.redis_key(key))
                found = await asyncio.wait_for(pipe.execute(), self.timeout_s)
        except _ERRORS as err:
            self.counters.read_errors += 1
            self._mark_down(err)
            return [False] * len(keys)
        return [bool(n) for n in found]

    async def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return await self.exists_many(keys)

    async def get(self, key: ChunkKey) -> Chunk | None:
        if not self.up:
            self.counters.misses += 1
            return None
        rkey = self.redis_key(key)
        try:
            value = await asyncio.wait_for(self._client.get(rkey), self.timeout_s)
        except _ERRORS as err:
            self.counters.read_errors += 1
            self._mark_down(err)
            self.counters.misses += 1
            return None
        if value is None:
            self.counters.misses += 1
            return None
        try:
            header = parse_header(value)
            payload = memoryview(value)[header.header_len :]
            verify_payload(header, payload, key.namespace, key.digest)
        except CorruptRecord as err:
            logger.warning("Redis value %r is damaged (%s); deleted, answered as a miss", rkey, err)
            self.counters.corrupt += 1
            self.counters.misses += 1
            try:
                await self._client.delete(rkey)
            except _ERRORS:
                pass
            return None
        self.counters.hits += 1
        return Chunk(payload, self.name)

    # -- removal -------------------------------------------------------------------
    async def delete(self, key: ChunkKey) -> bool:
        if not self.up:
            return False
        try:
            return bool(await asyncio.wait_for(self._client.delete(self.redis_key(key)), self.timeout_s))
        except _ERRORS as err:
            self._mark_down(err)
            return False

    async def clear(self, namespace: str | None) -> int:
        """Remove this daemon's keys (all under the prefix, or one namespace's) from Redis."""
        if not self.up:
            return 0
        pattern = self.key_prefix + (
            hashlib.sha256(namespace.encode()).hexdigest()[:16] + ":*" if namespace is not None else "*"
        )
        removed = 0
        try:
            batch: list[bytes] = []
            async for rkey in self._client.scan_iter(match=pattern, count=1000):
                batch.append(rkey)
                if len(batch) >= 500:
                    removed += await self._client.delete(*batch) if not self._cluster else await self._unlink(batch)
                    batch = []
            if batch:
                removed += await self._client.delete(*batch) if not self._cluster else await self._unlink(batch)
        except _ERRORS as err:
            self._mark_down(err)
        return removed

    @property
    def _cluster(self) -> bool:
        return isinstance(self._client, RedisCluster)

    async def _unlink(self, keys: list[bytes]) -> int:
        # Cluster: keys live in different slots, so delete them one by one (pipelined).
        async with self._client.pipeline(transaction=False) as pipe:
            for k in keys:
                pipe.delete(k)
            return sum(await pipe.execute())

    def keys(self) -> list[ChunkKey]:
        return []  # not enumerable cheaply; clear reports what it removed locally

    def namespaces(self) -> dict[str, tuple[int, int]]:
        return {}

    def stats(self) -> dict[str, Any]:
        return {
            "up": self.up,
            "url": redact(self.url),
            "queued_writes": len(self._queue) + self._writing,
            "queued_bytes": self._queued_bytes,
            "ttl_s": (self.ttl_ms or 0) / 1000,
            **dataclasses.asdict(self.counters),
        }
