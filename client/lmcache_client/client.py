"""Synchronous thin client (one DEALER socket; not thread-safe: one per thread).

Primitives: :class:`CacheClient` with ``hello, ping, put, get, get_into,
lookup, lookup_tokens, exists, delete, clear, pin, unpin, stats``, and
``put_tensors``/``get_tensors`` via :mod:`lmcache_client.tensors`.

Fail-open: with ``fail_open=True`` (the default) a daemon that is down, slow,
draining or BUSY answers the data ops like a miss (get -> None, lookup -> 0
hits, put -> FAILED); after the first failure a circuit breaker answers misses
at once, probing the daemon with a short ping every back-off period, so an
outage costs one ``timeout_s`` and then at most ``probe_timeout_s`` per
period (:mod:`lmcache_client.failopen`).  Outages are logged once and counted
in ``client.failures`` and ``client.short_circuited``, BUSY replies in
``client.busy_replies``.  With ``fail_open=False`` those raise
DaemonUnavailable or ServerError.  Admin ops (delete, clear, pin, stats)
always raise :class:`~lmcache_client.errors.DaemonUnavailable`.

Zero-copy data ops for callers that make or consume the bytes themselves:
``put_with(keys, sizes, fill)`` and ``get_with(keys, use)`` (over shared
memory ``fill``/``use`` see the pool slots themselves).

The client is a front object: its keyword arguments become one
:class:`~lmcache_client.options.ClientOptions`, from which it builds its two
parts, the transport (:class:`~lmcache_client.connection.Connection`: socket,
round trip, fail-open breaker) and the same-host path
(:class:`~lmcache_client.shm.SharedMemoryPath`: the mapped pool and its
flows, driven over that connection); this module holds the ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import zmq

from . import calls, shm
from .calls import LookupResult
from .connection import COPY_THRESHOLD, DEFAULT_ADDRESS, Connection, namespace_string, new_dealer, unavailable
from .failopen import FailOpen
from .keys import chunk_keys
from .namespace import Namespace
from .options import ClientOptions
from .protocol import PutStatus
from .shm import SharedMemoryPath, SharedPool

__all__ = [
    "COPY_THRESHOLD",
    "DEFAULT_ADDRESS",
    "CacheClient",
    "FailOpen",
    "namespace_string",
    "new_dealer",
    "unavailable",
]

T = TypeVar("T")


class CacheClient:
    """Blocking client of one lmcache-server daemon.

    ``namespace`` (a :class:`Namespace` or its wire string) is the default for
    data ops; every op also takes ``namespace=`` to override it.
    """

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        namespace: Namespace | str | None = None,
        *,
        timeout_s: float = 5.0,
        fail_open: bool = True,
        chunk_size: int | None = None,
        hwm: int = 64,
        context: zmq.Context[Any] | None = None,
        shared_memory: bool = True,
        copy_threads: int = 2,
        staged_puts: bool = True,
        server_public_key: str | None = None,
        client_secret_key: str | None = None,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        probe_timeout_s: float = 0.25,
    ):
        options = ClientOptions.parse(
            address,
            namespace,
            timeout_s=timeout_s,
            fail_open=fail_open,
            chunk_size=chunk_size,
            hwm=hwm,
            shared_memory=shared_memory,
            copy_threads=copy_threads,
            staged_puts=staged_puts,
            server_public_key=server_public_key,
            client_secret_key=client_secret_key,
            client_name="lmcache-client-py",
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
            probe_timeout_s=probe_timeout_s,
        )
        self.address = options.address
        self.namespace = options.namespace
        self.chunk_size = options.chunk_size
        self._conn = Connection(options, context)
        self._shm = SharedMemoryPath(options, self._conn)

    # -- lifecycle -----------------------------------------------------------------
    def close(self) -> None:
        self._shm.let_go()
        self._shm.unmap()
        self._conn.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the parts, as the client's callers see them -------------------------------
    @property
    def timeout_s(self) -> float:
        """A request's timeout (settable)."""
        return self._conn.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._conn.timeout_s = value

    @property
    def shared_memory(self) -> bool:
        """Use the daemon's pool directly when it offers it and this process can map it."""
        return self._shm.enabled

    @shared_memory.setter
    def shared_memory(self, value: bool) -> None:
        self._shm.enabled = value

    @property
    def failures(self) -> int:
        """Requests that found the daemon unreachable (answered fail-open or raised)."""
        return self._conn.breaker.failures

    @property
    def busy_replies(self) -> int:
        """Requests the daemon answered BUSY (a miss when failing open)."""
        return self._conn.breaker.busy_replies

    @property
    def short_circuited(self) -> int:
        """Data ops answered as a miss by the open circuit breaker, without a request."""
        return self._conn.breaker.short_circuited

    @property
    def fail_open_stats(self) -> dict[str, Any]:
        """failures, busy_replies, short_circuited, outages and whether the daemon is down now."""
        return self._conn.breaker.stats()

    @property
    def uses_shared_memory(self) -> bool:
        """Whether data ops go through the daemon's mapped pool (probes the daemon once)."""
        return self._shm.uses_shared_memory()

    def pin_shared_pool(self) -> bool:
        """Page-lock this process's mapping of the daemon's pool for CUDA DMA
        (``cudaHostRegister``); False when there is no mapped pool or CUDA refuses."""
        return self._shm.pin_shared_pool()

    def _run(self, call: calls.Call[T], timeout_s: float | None = None) -> T:
        return self._conn.run(call, timeout_s)

    def _shared_pool(self) -> SharedPool | None:
        return self._shm.shared_pool()

    @property
    def _pool(self) -> SharedPool | None:
        return self._shm.pool

    def _ns(self, namespace: Namespace | str | None) -> str:
        ns = namespace_string(namespace) or self.namespace
        if not ns:
            raise ValueError("no namespace: pass namespace= here or to the client")
        return ns

    # -- ops -----------------------------------------------------------------------
    def hello(self, client_name: str = "lmcache-client-py") -> dict[str, Any]:
        """Version handshake; returns the server's capabilities and limits."""
        return self._run(calls.hello(client_name))

    def ping(self, timeout_s: float | None = None) -> float:
        """Round-trip time in seconds; raises DaemonUnavailable if there is no answer."""
        return self._run(calls.ping(), timeout_s)

    def put(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[Any],
        *,
        namespace: Namespace | str | None = None,
        tokens: calls.TokensArg = None,
    ) -> list[PutStatus | int]:
        """Store one payload per key; a PutStatus per key (a bare int for a status
        this client does not know).  Do not modify the payload buffers until it returns.
        ``tokens``: each chunk's token ids (keys.chunk_tokens), for a daemon that
        publishes KV events (its hello offers ``events``; docs/events.md).

        On the daemon's host, large puts are copied straight into its pool."""
        ns = self._ns(namespace)
        call = calls.put(ns, keys, payloads, tokens)
        if sum(memoryview(p).nbytes for p in payloads) < shm.PUT_MIN_BYTES:
            return self._run(call)
        return self._shm.over_shm(
            lambda pool: shm.put_flow(pool, ns, keys, payloads, tokens),
            lambda: self._run(call),
            lambda: [PutStatus.FAILED] * len(keys),
        )

    def get(self, keys: Sequence[bytes], *, namespace: Namespace | str | None = None) -> list[Any | None]:
        """One read-only buffer (memoryview) per key, None for a miss.

        On the daemon's host the bytes are copied once out of its pool."""
        ns = self._ns(namespace)
        return self._shm.over_shm(
            lambda pool: shm.get_flow(pool, ns, keys, None),
            lambda: self._run(calls.get(ns, keys)),
            lambda: [None] * len(keys),
        )

    def lookup(
        self,
        keys: Sequence[bytes],
        *,
        namespace: Namespace | str | None = None,
        prefetch: bool = False,
        cancel_prefetch: bool = False,
    ) -> LookupResult:
        """How many leading keys are cached, and the tier holding each key (as found now).
        ``prefetch``: the daemon then promotes the leading hits it holds on disk or in
        Redis into memory in the background, so a get that follows is a memory hit.
        ``cancel_prefetch``: it gives up the prefetches that lookups of these keys
        started or joined (the request they were for ended first)."""
        return self._run(calls.lookup(self._ns(namespace), keys, prefetch=prefetch, cancel_prefetch=cancel_prefetch))

    def lookup_tokens(self, tokens: Sequence[int], *, namespace: Namespace | str | None = None) -> int:
        """Number of leading tokens whose KV chunks are cached (a multiple of chunk_size)."""
        if self.chunk_size is None:
            raise ValueError("lookup_tokens needs chunk_size (pass it or a Namespace to the client)")
        keys = chunk_keys(tokens, self.chunk_size)
        if not keys:
            return 0
        return self.lookup(keys, namespace=namespace).hit_chunks * self.chunk_size

    def exists(self, keys: Sequence[bytes], *, namespace: Namespace | str | None = None) -> list[bool]:
        return self._run(calls.exists(self._ns(namespace), keys))

    def delete(self, keys: Sequence[bytes], *, namespace: Namespace | str | None = None) -> list[bool]:
        return self._run(calls.delete(self._ns(namespace), keys))

    def pin(self, keys: Sequence[bytes], *, namespace: Namespace | str | None = None) -> list[bool]:
        """Keep these chunks from eviction until unpinned; chunks on disk or in Redis
        are promoted first (False: no tier holds it, or no room to promote it).
        ServerError PIN_LIMIT: over ``max_pinned_fraction``, nothing pinned."""
        return self._run(calls.pin(self._ns(namespace), keys))

    def unpin(self, keys: Sequence[bytes], *, namespace: Namespace | str | None = None) -> list[bool]:
        return self._run(calls.unpin(self._ns(namespace), keys))

    def prefetch(self, keys: Sequence[bytes], *, namespace: Namespace | str | None = None) -> calls.PrefetchResult:
        """Promote these chunks from disk or Redis into memory now (the operator's cache API)."""
        return self._run(calls.prefetch(self._ns(namespace), keys))

    def clear(self, *, namespace: Namespace | str | None = None, all_namespaces: bool = False) -> int:
        """Remove every chunk of the namespace (or of all of them); returns how many."""
        return self._run(calls.clear(None if all_namespaces else self._ns(namespace)))

    def stats(self, *, namespace: Namespace | str | None = None) -> dict[str, Any]:
        return self._run(calls.stats(namespace_string(namespace)))

    def put_tensors(
        self, keys: Sequence[bytes], tensors: Sequence[Any], *, namespace: Namespace | str | None = None
    ) -> list[PutStatus | int]:
        """Put contiguous torch tensors without copying them into bytes first.

        Over shared memory each tensor is copied once into the pool (a CUDA
        tensor by DMA); over frames the tensors must be on the CPU."""
        from .tensors import tensor_bytes

        ns = self._ns(namespace)

        def frames() -> list[PutStatus | int]:
            return self._run(calls.put(ns, keys, [tensor_bytes(t) for t in tensors]))

        return self._shm.over_shm(
            lambda pool: shm.put_flow(pool, ns, keys, tensors),
            frames,
            lambda: [PutStatus.FAILED] * len(keys),
        )

    def put_with(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        fill: shm.FillFn,
        *,
        namespace: Namespace | str | None = None,
        tokens: calls.TokensArg = None,
        flush: shm.FlushFn | None = None,
    ) -> list[PutStatus | int]:
        """Store ``len(keys)`` payloads that ``fill(i, view)`` writes into ``view``
        (writable, ``sizes[i]`` bytes): over shared memory straight into the
        daemon's pool slot (one copy in all, the caller's), else into a buffer
        then sent.  ``fill`` is not called for keys that need no bytes (already
        stored, no room); an exception from it stores none of the batch.  Given a
        ``flush``, ``fill`` may write the views as late as that call: once, after
        the batch's last ``fill`` and before the bytes are committed or sent.
        ``tokens`` as for :meth:`put`."""
        ns = self._ns(namespace)
        if len(sizes) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes")

        def frames() -> list[PutStatus | int]:
            bufs = [bytearray(n) for n in sizes]
            for i, buf in enumerate(bufs):
                fill(i, memoryview(buf))
            if flush is not None:
                flush()
            return self._run(calls.put(ns, keys, bufs, tokens))

        return self._shm.over_shm(
            lambda pool: shm.fill_flow(pool, ns, keys, sizes, fill, tokens, flush=flush),
            frames,
            lambda: [PutStatus.FAILED] * len(keys),
        )

    def get_with(
        self,
        keys: Sequence[bytes],
        use: shm.UseFn,
        *,
        nbytes: int | None = None,
        prefix: bool = False,
        namespace: Namespace | str | None = None,
        flush: shm.FlushFn | None = None,
    ) -> list[bool]:
        """Call ``use(i, view)`` for each hit with its bytes (over shared memory the
        leased pool slot itself: do not keep ``view``, or, given a ``flush``, keep it
        only until that call, made once before the views are released); True where
        ``use`` ran on bytes that stayed valid throughout.  ``nbytes``: a hit of
        another size is a miss; ``prefix``: stop at the first miss."""
        ns = self._ns(namespace)

        def frames() -> list[bool]:
            bufs: list[Any] = self._run(calls.get(ns, keys))
            return shm.use_frames(bufs, use, nbytes=nbytes, prefix=prefix, flush=flush)

        return self._shm.over_shm(
            lambda pool: shm.use_flow(pool, ns, keys, use, nbytes=nbytes, prefix=prefix, flush=flush),
            frames,
            lambda: [False] * len(keys),
        )

    def get_into(
        self, keys: Sequence[bytes], out: Sequence[Any], *, namespace: Namespace | str | None = None
    ) -> list[bool]:
        """Copy each hit into ``out[i]`` (a contiguous torch tensor, or a writable
        buffer, of exactly the chunk's size); True where it was a hit.

        Over shared memory the bytes go from the daemon's pool straight into the
        destination: one memcpy (one DMA for a CUDA tensor)."""
        ns = self._ns(namespace)
        if len(out) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(out)} destinations")

        def frames() -> list[bool]:
            bufs = self._run(calls.get(ns, keys))
            return [buf is not None and shm.copy_frame(buf, dest) for dest, buf in zip(out, bufs)]

        return self._shm.over_shm(
            lambda pool: shm.get_flow(pool, ns, keys, out),
            frames,
            lambda: [False] * len(keys),
        )
