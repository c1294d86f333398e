"""The connection side of the Redis uplink (:mod:`.remote`): one redis-py client
(a single server, TLS, a unix socket, or a Redis Cluster), the daemon's key
names, the up/down state with its background reconnect, and the raw removal
commands.  :class:`.tier.RemoteTier` holds one and hands it to its writer
(:class:`.writer.RemoteWriter`) and its carryover (:class:`.carryover.RemoteCarryover`).

- Any Redis error a request or the writer meets marks the link down (logged
  once) and drops every pooled connection (they lead to the old server); a
  background probe (redis-py's ``Retry``: exponential backoff with jitter, no
  limit) brings it back and counts a reconnect.
- Each command also retries on a fresh connection (redis-py's ``Retry``,
  COMMAND_RETRIES times) before it counts as a failure.

It is one of the two links :class:`.tier.RemoteTier` runs on (the other is
:class:`.mooncake.MooncakeLink`); both have the primitives the tier and its
writer use: ``connect``, ``failed``, ``mark_down``, ``remote_key``, ``exists``,
``sizes``, ``read``, ``write``, ``drop``, ``remove``, ``clear``, ``aclose``.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ...config import redact
from ...supervisor import Supervisor
from ..base import ChunkKey
from .links import LinkState, key_name, key_scope
from .links import RemoteCounters as RemoteCounters  # re-exported

logger = logging.getLogger(__name__)

ERRORS = (RedisError, OSError, TimeoutError, asyncio.TimeoutError)
"""What a Redis or network failure raises."""
COMMAND_RETRIES = 2
"""Retries of one command on a fresh connection (redis-py's Retry) before it counts as a failure."""
TIMEOUTS = (TimeoutError, asyncio.TimeoutError, RedisTimeoutError)
"""What a request that ran out of time raises (one of ERRORS)."""


class RedisLink:
    """A redis-py client with the daemon's key names and an up/down state.

    ``errors`` are what an outage raises, ``timeouts`` the ones of them that a
    request too big for the link in time raises too (the writer halves its batches).
    ``state`` (:class:`.links.LinkState`) is up or down; ``on_down`` is called after
    each failure that marks it down.

    ``up`` is False from a failure until the background probe reaches Redis
    again; ``wake`` is set whenever the state changes (the tier's writer waits
    on it); ``on_down`` is called after each failure that marks it down."""

    name = "redis"
    label = "Redis uplink"  # how log lines name the tier
    from_pool = False  # a SET sends one copied record
    errors: tuple[type[BaseException], ...] = ERRORS
    timeouts: tuple[type[BaseException], ...] = TIMEOUTS

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str,
        timeout_s: float,
        username: str | None = None,
        password: str | None = None,
        max_backoff_s: float = 2.0,
        supervisor: Supervisor | None = None,
        on_down: Callable[[], None] | None = None,
    ):
        self.url = url
        self.key_prefix = key_prefix
        self.timeout_s = timeout_s
        self.max_backoff_s = max_backoff_s
        self.state = LinkState(self.name, self.label, redact(url), ERRORS, self._reconnect, supervisor, on_down)
        self.client = self._connect(url, username, password)

    def _connect(self, url: str, username: str | None, password: str | None) -> Any:
        kwargs: dict[str, Any] = {
            "socket_timeout": self.timeout_s,
            "socket_connect_timeout": self.timeout_s,
            "decode_responses": False,
            # A command that fails on a dead connection is sent again on a new one.
            "retry": Retry(ExponentialWithJitterBackoff(cap=0.25, base=0.01), COMMAND_RETRIES),
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

    def remote_key(self, key: ChunkKey) -> bytes:
        return key_name(self.key_prefix, key).encode()

    async def connect(self) -> None:
        """The first contact, at the tier's open: up when Redis answers a ping within
        ``timeout_s``, else down (reconnecting in the background): never a failed start."""
        try:
            await asyncio.wait_for(self.client.ping(), self.timeout_s)
            self.state.connected()
        except Exception as err:  # a client library surprised by the handshake too: down, never a failed start
            self.state.failed("connect", err)

    async def _drop_connections(self) -> None:
        """Close the idle pooled connections: after an outage they lead to the old
        server.  Ones in use are left to their command, which fails (and is
        retried on a fresh connection) by itself: closing them underneath it
        would turn a Redis outage into an error nobody expects."""
        try:
            if isinstance(self.client, RedisCluster):
                await self.client.aclose()  # the next command rediscovers the nodes
            else:
                await self.client.connection_pool.disconnect(inuse_connections=False)
        except Exception:  # best effort: a connection that cannot even close is gone
            pass

    async def _reconnect(self) -> None:
        """The state's probe: until Redis answers (redis-py's Retry: exponential backoff with jitter, no limit)."""
        await self._drop_connections()
        # Any error is retried: a server that garbles its handshake is down, not a dead probe.
        probe = Retry(ExponentialWithJitterBackoff(cap=self.max_backoff_s, base=0.1), -1, (Exception,))

        async def ping() -> None:
            await asyncio.wait_for(self.client.ping(), self.timeout_s)

        async def failed(err: Exception) -> None:
            await self._drop_connections()

        await probe.call_with_retry(ping, failed)
        await self._drop_connections()  # whatever was opened while it was coming back starts afresh

    # -- the requests the tier and its writer send -------------------------------------
    async def exists(self, rkeys: Sequence[bytes]) -> list[Any]:
        """EXISTS of each key, in one round trip (what Redis answered: validated by the tier)."""
        async with self.client.pipeline(transaction=False) as pipe:
            for rkey in rkeys:
                pipe.exists(rkey)
            return list(await asyncio.wait_for(pipe.execute(), self.timeout_s))

    async def sizes(self, rkeys: Sequence[bytes]) -> list[Any]:
        """STRLEN of each key in one round trip; an error Redis answers for a key comes back as it."""
        async with self.client.pipeline(transaction=False) as pipe:
            for rkey in rkeys:
                pipe.strlen(rkey)
            return list(await asyncio.wait_for(pipe.execute(raise_on_error=False), self.timeout_s))

    async def read(self, rkeys: Sequence[bytes]) -> list[Any]:
        """GET of each key in one round trip: the value, None (not stored), or the
        error Redis answered for that key.  Bounded by ``timeout_s`` per key."""
        async with self.client.pipeline(transaction=False) as pipe:
            for rkey in rkeys:
                pipe.get(rkey)
            return list(await asyncio.wait_for(pipe.execute(raise_on_error=False), self.timeout_s * len(rkeys)))

    async def write(self, records: Sequence[tuple[ChunkKey, Any]], ttl_ms: int | None) -> list[bool]:
        """SET each record in one round trip; every one was stored (True) or this raises."""
        # A memoryview goes out as its own chunk (redis-py's asyncio packer), uncopied.
        if len(records) == 1:
            key, record = records[0]
            await self.client.set(self.remote_key(key), record, px=ttl_ms)
        else:
            async with self.client.pipeline(transaction=False) as pipe:
                for key, record in records:
                    pipe.set(self.remote_key(key), record, px=ttl_ms)
                await pipe.execute()
        return [True] * len(records)

    async def drop(self, rkey: bytes) -> None:
        """Delete one damaged value (best effort)."""
        try:
            await asyncio.wait_for(self.client.delete(rkey), self.timeout_s)
        except ERRORS:
            pass

    async def aclose(self) -> None:
        try:
            await self.client.aclose()
        except ERRORS:
            pass

    async def remove(self, keys: Sequence[ChunkKey]) -> int:
        rkeys = [self.remote_key(k) for k in keys]
        if self._cluster:
            return await asyncio.wait_for(self._unlink(rkeys), self.timeout_s)
        return int(await asyncio.wait_for(self.client.delete(*rkeys), self.timeout_s))

    async def clear(self, namespace: str | None) -> int:
        pattern = key_scope(self.key_prefix, namespace) + "*"
        removed = 0
        batch: list[bytes] = []
        async for rkey in self.client.scan_iter(match=pattern, count=1000):
            batch.append(rkey)
            if len(batch) >= 500:
                removed += await self.client.delete(*batch) if not self._cluster else await self._unlink(batch)
                batch = []
        if batch:
            removed += await self.client.delete(*batch) if not self._cluster else await self._unlink(batch)
        return removed

    @property
    def _cluster(self) -> bool:
        return isinstance(self.client, RedisCluster)

    async def _unlink(self, keys: list[bytes]) -> int:
        # Cluster: keys live in different slots, so delete them one by one (pipelined).
        async with self.client.pipeline(transaction=False) as pipe:
            for k in keys:
                pipe.delete(k)
            return sum(await pipe.execute())
