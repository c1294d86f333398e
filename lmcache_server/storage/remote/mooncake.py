"""The Mooncake Store link (:class:`MooncakeLink`): the remote tier on the DRAM that every
node contributes to a Mooncake cluster, instead of one Redis.

- A cluster is one ``mooncake_master`` (object metadata and allocation, in memory), a
  metadata server (the master's built-in HTTP one by default) and the nodes' store
  clients.  Each daemon is one client: it mounts a segment of ``segment_size`` bytes of
  its own DRAM into the cluster pool (0: it stores nothing for others) and a transfer
  buffer of ``buffer_size`` bytes; a value lives in the segment the master placed it
  in, on whichever node, and a read pulls it from there (TCP here, RDMA on clusters).
- The daemon's pool is not the segment: the master allocates objects inside a segment
  with its own allocator, and the pool has its own allocator and leases.
- Keys and values are the Redis tier's: ``<prefix><namespace tag>:<key hex>`` and
  :mod:`..chunkfile` records with namespace, key, token ids and CRC32C, so a torn
  value, one of another installation (another ``remote_key_prefix``) or of another
  namespace is a miss, never wrong bytes.
- Writes go out of the memory pool (``zero_copy``, the default): the writer builds
  only each record's header (the checksum) and the transfer engine reads the payload
  straight from the pool (``batch_put_from_multi_buffers``: header, payload), the
  pool's lease held until the write leaves the queue; no copy in Python, none into
  the client's buffer.  With RDMA the pool and the header area are registered with
  the client (``register_buffer``: the NIC reads only registered memory, and peers can
  then reach it); TCP reads any memory, so there only the header area is.  ``zero_copy`` off: a copied
  record per chunk, put from Python bytes (``put_batch``), as on Redis.
- Reads take the values in the client's transfer buffer (``batch_get_buffer``) and
  verify them there; the chunk's bytes are read from that buffer until promotion
  copies them into the pool (no copy into Python ``bytes``).  Mooncake never writes
  into the pool itself: a transfer that outlived its call could still land in a
  slot that was given to another chunk after it was verified.
- Every call of the C++ client blocks: they run on the link's own threads, each
  bounded by ``timeout_s`` (a call that outlives it keeps its thread, the request
  gets its miss).  The transfers let go of the GIL (``batch_get_buffer`` rather than
  ``get_batch``, which holds it while it copies); the setup does not, so it is only
  tried once the master and the metadata server accept connections.
- Status codes: 0 is success; ``OBJECT_NOT_FOUND`` a miss;
  ``NO_AVAILABLE_HANDLE`` / ``TRANSFER_FAIL`` on a write: no room now (the pool is
  full until the master evicts, or the holding node left), tried again; an RPC
  failure, an uninitialised client or a master that does not answer: an outage.
- Outage: the link goes down (reads are misses, writes wait in the queue) and a
  probe with exponential backoff and jitter brings it back: it sets a new client up
  when the last one never got up, else waits for the client's own health check (the
  client remounts its segment by itself after a master restart; what the master knew
  before is gone, so the chunks written before are misses and written again as used).
- No TTL (the master evicts above its watermark), no authentication, no TLS: keep the
  master and the nodes on a private network (docs/storage.md).

Primitives: :class:`MooncakeSettings` (``from_url``), :class:`MooncakeLink`
(the :class:`.links.RemoteLink` protocol).
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import importlib
import logging
import random
import re
import socket
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...supervisor import Supervisor
from ..base import ChunkKey
from .links import LinkState, key_name, key_scope

logger = logging.getLogger(__name__)

OK = 0
NO_AVAILABLE_HANDLE = -200  # no room in the pool (until the master evicts)
INVALID_PARAMS = -600  # also what an uninitialised client answers
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
TRANSFER_FAIL = -800  # the node that holds (or was to hold) the value did not answer
OUTAGE_CODES = frozenset({-900, -901, INVALID_PARAMS, -1010, -1011})
"""RPC_FAIL, RPC_TIMEOUT, the client not initialised, the master not serving: the link is down."""
HEALTHY = 0  # health_check(): 1 not initialised or closed, 2 master unreachable
HEADER_AREA = 256 << 10
"""Bytes of the registered area the headers of one batch are put from (grown when short)."""
THREADS = 4
"""Threads the blocking C++ calls run on (a call that hangs holds one until it returns)."""
DEFAULT_METADATA_PORT = 8080
"""The port of the master's built-in HTTP metadata server when it is not set."""


class MooncakeError(Exception):
    """Mooncake answered a status code nothing expects (``code``)."""

    def __init__(self, op: str, code: int):
        super().__init__(f"{op} answered {code}")
        self.code = code


class MooncakeUnavailable(MooncakeError):
    """The master (or the client's connection to it) is not there: an outage."""


ERRORS = (MooncakeUnavailable, OSError, TimeoutError, asyncio.TimeoutError)
TIMEOUTS = (TimeoutError, asyncio.TimeoutError)


def _check(op: str, code: int) -> int:
    if code in OUTAGE_CODES:
        raise MooncakeUnavailable(op, code)
    return code


def _stored(op: str, code: int) -> bool:
    """A put's status: stored (or there already), no room now (False), or it raises."""
    if _check(op, code) in (OK, OBJECT_ALREADY_EXISTS):
        return True
    if code in (NO_AVAILABLE_HANDLE, TRANSFER_FAIL):
        return False
    raise MooncakeError(op, code)


@dataclasses.dataclass(frozen=True)
class MooncakeSettings:
    """Where the cluster is and what this node brings to it (the ``mooncake_*`` keys)."""

    master: str  # HOST:PORT of mooncake_master's RPC port
    metadata_server: str  # http://HOST:PORT/metadata, etcd://HOST:PORT or P2PHANDSHAKE
    protocol: str = "tcp"  # or rdma
    device_name: str = ""  # RDMA devices, comma separated
    local_hostname: str = ""  # where other nodes reach this node's segment (host or host:port)
    segment_size: int = 1 << 30
    buffer_size: int = 256 << 20
    zero_copy: bool = True  # writes from the pool (False: a copied record, as on Redis)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        metadata_server: str | None = None,
        protocol: str = "tcp",
        device_name: str | None = None,
        local_hostname: str | None = None,
        segment_size: int = 1 << 30,
        buffer_size: int = 256 << 20,
        zero_copy: bool = True,
    ) -> MooncakeSettings:
        """Settings from ``mooncake://HOST:PORT`` (or LMCache's ``mooncakestore://``) and the keys;
        the metadata server defaults to the master's built-in one, the local host name to
        this host's address."""
        parsed = urllib.parse.urlsplit(url)
        if not parsed.hostname:
            raise ValueError(f"{url!r} names no master host")
        host = f"[{parsed.hostname}]" if ":" in parsed.hostname else parsed.hostname
        master = f"{host}:{parsed.port or 50051}"
        if metadata_server is None:
            metadata_server = f"http://{host}:{DEFAULT_METADATA_PORT}/metadata"
        return cls(
            master=master,
            metadata_server=metadata_server,
            protocol=protocol,
            device_name=device_name or "",
            local_hostname=local_hostname or _host_address(),
            segment_size=segment_size,
            buffer_size=buffer_size,
            zero_copy=zero_copy,
        )


def _host_address() -> str:
    """This host's address as other nodes reach it (its name's address; loopback as a last resort)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _address(buffer: Any) -> int:
    """Where a writable buffer's bytes start."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def _view(handle: Any) -> memoryview:
    """The bytes of a value in the client's transfer buffer, without a copy; the view
    keeps ``handle`` (which frees that buffer space when collected) alive."""
    area = (ctypes.c_char * handle.size()).from_address(handle.ptr())
    area.handle = handle  # freed with the last view of it
    return memoryview(area).cast("B")


class MooncakeLink:
    """One Mooncake Store client with the daemon's key names and an up/down state
    (the :class:`.links.RemoteLink` protocol).  ``on_down`` is called after each
    failure that marks it down; ``regions`` (address, size) are registered with the
    client: the memory pool its writes are sent from."""

    name = "mooncake"
    label = "Mooncake tier"
    errors: tuple[type[BaseException], ...] = ERRORS
    timeouts: tuple[type[BaseException], ...] = TIMEOUTS

    def __init__(
        self,
        url: str,
        settings: MooncakeSettings,
        *,
        key_prefix: str,
        timeout_s: float,
        max_backoff_s: float = 2.0,
        supervisor: Supervisor | None = None,
        on_down: Callable[[], None] | None = None,
        regions: Sequence[tuple[int, int]] = (),
    ):
        self.url = url
        self.settings = settings
        self.from_pool = settings.zero_copy
        self._regions = list(regions)
        self._headers = bytearray(HEADER_AREA)  # the headers of the batch being put (registered)
        self.key_prefix = key_prefix
        self.timeout_s = timeout_s
        self.max_backoff_s = max_backoff_s
        self.state = LinkState(self.name, self.label, settings.master, ERRORS, self._reconnect, supervisor, on_down)
        self._threads = ThreadPoolExecutor(THREADS, thread_name_prefix="lmcache-mooncake")
        self._store: Any = None  # the client, once set up
        self._setting_up: asyncio.Future[Any] | None = None  # a setup still running on a thread
        self._module = importlib.import_module("mooncake.store")  # fails the start when not installed

    # -- the client's calls, on the link's threads -------------------------------------
    async def _call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
        future = asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)
        return await asyncio.wait_for(future, self.timeout_s if timeout_s is None else timeout_s)

    def _client(self) -> Any:
        if self._store is None:
            raise MooncakeUnavailable("client", INVALID_PARAMS)
        return self._store

    def _new_client(self) -> Any:
        """A client set up on the cluster (runs on a thread); raises when it cannot be."""
        s = self.settings
        store = self._module.MooncakeDistributedStore()
        code = store.setup(
            s.local_hostname, s.metadata_server, s.segment_size, s.buffer_size, s.protocol, s.device_name, s.master
        )
        if code != OK:
            raise MooncakeUnavailable("setup", code)
        # RDMA reads only registered memory; TCP reads any.  A registered region is reachable
        # by the cluster's peers (Mooncake authenticates no one), so the pool is registered
        # only where the transport needs it.
        regions = self._regions if s.protocol == "rdma" else []
        for address, size in [*regions, (_address(self._headers), len(self._headers))]:
            code = store.register_buffer(address, size)
            if code != OK:
                logger.warning("Mooncake tier: registering %d MiB at %#x answered %d", size >> 20, address, code)
        return store

    async def _reachable(self) -> None:
        """Raise unless the master's RPC port and the metadata server accept a connection.
        The client's setup holds the GIL while it retries an absent master (for about a
        minute and a half), which would stop the event loop: it is only called once both answer."""
        addresses = [self.settings.master]
        metadata = urllib.parse.urlsplit(self.settings.metadata_server)
        if metadata.hostname:
            addresses.append(f"{metadata.hostname}:{metadata.port or (443 if metadata.scheme == 'https' else 80)}")
        for address in addresses:
            host, _, port = address.rpartition(":")
            _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), self.timeout_s)
            writer.close()

    async def _set_up(self) -> None:
        """Set a client up, once the cluster is reachable; one setup at a time: one that
        outlived its timeout is awaited by the next try, never started twice."""
        if self._setting_up is None:
            await self._reachable()
            self._setting_up = asyncio.get_running_loop().run_in_executor(self._threads, self._new_client)
        setting_up = self._setting_up
        try:
            store = await asyncio.wait_for(asyncio.shield(setting_up), max(self.timeout_s, 10.0))
        finally:
            if setting_up.done():  # succeeded or failed: the next try starts afresh (reachability first)
                self._setting_up = None
        self._store = store

    # -- the up/down state ---------------------------------------------------------------
    async def connect(self) -> None:
        """The first contact, at the tier's open: up when a client is set up within the
        timeout, else down (reconnecting in the background): never a failed start."""
        try:
            await self._set_up()
            self.state.connected()
            s = self.settings
            logger.info("Mooncake tier: segment %d MiB at %s, %s, puts %s",
                        s.segment_size >> 20, s.local_hostname, s.protocol,
                        "from the pool" if s.zero_copy else "of copied records")  # fmt: skip
        except Exception as err:
            self.state.failed("connect", err)

    async def _reconnect(self) -> None:
        """The state's probe: until the cluster answers: a new client when there is none,
        else the client's health check (it remounts its segment by itself after a master
        restart)."""
        delay = 0.1
        while True:
            try:
                if self._store is None:
                    await self._set_up()
                if await self._call(self._store.health_check) == HEALTHY:
                    break
            except Exception as err:
                logger.debug("Mooncake tier: probe failed (%s)", err)
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, self.max_backoff_s)

    # -- keys ------------------------------------------------------------------------------
    def remote_key(self, key: ChunkKey) -> str:
        return key_name(self.key_prefix, key)

    # -- the requests the tier and its writer send -----------------------------------------
    async def exists(self, rkeys: Sequence[str]) -> list[Any]:
        found = await self._call(self._client().batch_is_exist, list(rkeys))
        for code in found:
            if code < 0:
                _check("exist", code)
        return [1 if code == 1 else 0 for code in found]

    async def sizes(self, rkeys: Sequence[str]) -> list[Any]:
        store = self._client()

        def sizes() -> list[int]:
            return [_check("get_size", store.get_size(rkey)) for rkey in rkeys]

        return [max(n, 0) for n in await self._call(sizes, timeout_s=self.timeout_s * max(len(rkeys), 1))]

    async def read(self, rkeys: Sequence[str]) -> list[Any]:
        """Each value, viewed where the client received it; None: not stored (or its node
        is gone).  A batch with misses while the master is unreachable is an outage."""
        store = self._client()

        def read() -> list[Any]:
            handles = store.batch_get_buffer(list(rkeys))
            if any(h is None for h in handles) and store.health_check() != HEALTHY:
                raise MooncakeUnavailable("get", -900)
            return [None if h is None else _view(h) for h in handles]

        return list(await self._call(read, timeout_s=self.timeout_s * max(len(rkeys), 1)))

    async def write(self, records: Sequence[tuple[ChunkKey, Any]], ttl_ms: int | None) -> list[bool]:
        """Put the records; True: stored (or already there: keys name their bytes), False:
        no room now.  From the pool: one ``batch_put_from_multi_buffers`` (header, payload
        per key).  Copied records: one ``put_batch``; when it fails, each key alone."""
        store = self._client()
        keys = [self.remote_key(k) for k, _ in records]
        values = [v for _, v in records]
        if any(isinstance(v, tuple) for v in values):
            return list(await self._call(self._put_parts, store, keys, values, timeout_s=self._write_timeout(values)))

        def write() -> list[bool]:
            if _check("put_batch", store.put_batch(keys, values)) == OK:
                return [True] * len(keys)
            return [_stored("put", store.put(rkey, value)) for rkey, value in zip(keys, values)]

        return list(await self._call(write, timeout_s=self._write_timeout(values)))

    def _write_timeout(self, values: Sequence[Any]) -> float:
        return self.timeout_s * max(1, len(values))

    def _put_parts(self, store: Any, keys: list[str], values: list[Any]) -> list[bool]:
        """Put each value from where it lies (runs on a thread): a (header, payload) pair as
        two buffers, the header copied into the registered header area; a record as one."""
        need = sum(len(v[0]) for v in values if isinstance(v, tuple))
        if need > len(self._headers):  # grow the area (registered again)
            store.unregister_buffer(_address(self._headers))
            self._headers = bytearray(max(need, 2 * len(self._headers)))
            store.register_buffer(_address(self._headers), len(self._headers))
        base, offset = _address(self._headers), 0
        pointers: list[list[int]] = []
        sizes: list[list[int]] = []
        for value in values:
            if isinstance(value, tuple):
                header, payload = value
                self._headers[offset : offset + len(header)] = header
                pointers.append([base + offset, _address(payload)])
                sizes.append([len(header), payload.nbytes])
                offset += len(header)
            else:
                pointers.append([_address(value)])
                sizes.append([memoryview(value).nbytes])
        codes = store.batch_put_from_multi_buffers(keys, pointers, sizes)
        return [_stored("put_from", code) for code in codes]

    async def drop(self, rkey: str) -> None:
        try:
            await self._call(self._client().remove, rkey, True)
        except Exception:  # best effort
            pass

    async def remove(self, keys: Sequence[ChunkKey]) -> int:
        codes = await self._call(self._client().batch_remove, [self.remote_key(k) for k in keys], True)
        for code in codes:
            if code < 0:
                _check("remove", code)
        return sum(1 for code in codes if code == OK)

    async def clear(self, namespace: str | None) -> int:
        pattern = "^" + re.escape(key_scope(self.key_prefix, namespace))
        removed = await self._call(self._client().remove_by_regex, pattern, True)
        return max(_check("remove_by_regex", removed), 0)

    async def aclose(self) -> None:
        """Close the client (its segment leaves the cluster: the values in it become
        misses on every node) and the link's threads."""
        store, self._store = self._store, None
        if store is not None:
            try:
                await self._call(store.close, timeout_s=max(self.timeout_s, 10.0))
            except Exception as err:
                logger.warning("Mooncake tier: closing the client failed (%s)", err)
        self._threads.shutdown(wait=False, cancel_futures=True)
