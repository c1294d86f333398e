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
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import zmq

from . import calls, shm
from .calls import Call, LookupResult
from .curve import CurveKeys
from .errors import ClientError, DaemonUnavailable, ServerError
from .failopen import MISS, PROBE, FailOpen

__all__ = [
    "COPY_THRESHOLD",
    "DEFAULT_ADDRESS",
    "CacheClient",
    "FailOpen",
    "namespace_string",
    "new_dealer",
    "unavailable",
]
from .handshake import HandshakeWatch
from .keys import chunk_keys
from .namespace import Namespace
from .protocol import Op, PutStatus, Reply, decode_reply, encode_request
from .shm import SharedPool

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_ADDRESS = "tcp://127.0.0.1:65432"
COPY_THRESHOLD = 64 * 1024
"""Payloads at least this large are sent zero-copy (pyzmq copies smaller ones anyway)."""


def _unused_parse(reply: Reply, payloads: list[Any]) -> Any:
    raise AssertionError("a breaker stand-in call is never sent")


def namespace_string(namespace: Namespace | str | None) -> str | None:
    return namespace.wire() if isinstance(namespace, Namespace) else namespace


def new_dealer(
    ctx: zmq.Context[Any], address: str, hwm: int, curve: CurveKeys | None = None, watch: bool = False
) -> Any:
    """A DEALER socket connected to ``address`` (sync or asyncio, after ``ctx``'s kind),
    a CURVE client of the daemon when ``curve`` is given.  ``watch``: return
    ``(socket, HandshakeWatch)``, the watch attached before the socket connects."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(sock)
    # IMMEDIATE: queue only on completed connections, so a dead daemon is
    # noticed at send time instead of messages piling up for later delivery.
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if not watch:
        sock.connect(address)
        return sock
    handshakes = HandshakeWatch(sock, curve is not None)
    sock.connect(address)
    return sock, handshakes


def unavailable(what: str, handshakes: HandshakeWatch | None) -> DaemonUnavailable:
    """DaemonUnavailable saying ``what``, and why the handshake failed when it did."""
    reason = handshakes.reason() if handshakes is not None else None
    return DaemonUnavailable(f"{what}: {reason}" if reason else what)


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
        self.address = address
        # auth: curve daemons: the daemon's public key and this client's secret
        # key, each as Z85 text or a key file path (docs/security.md).
        self._curve = CurveKeys.from_options(server_public_key, client_secret_key)
        self.namespace = namespace_string(namespace)
        self.chunk_size = chunk_size or (namespace.chunk_size if isinstance(namespace, Namespace) else None)
        self.timeout_s = timeout_s
        self._hwm = hwm
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket[Any] | None = None
        self._handshakes: HandshakeWatch | None = None
        self._reset()
        self._ids = itertools.count(int.from_bytes(os.urandom(4), "little") << 20)
        self._fail = FailOpen(
            fail_open,
            address,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
            probe_timeout_s=min(probe_timeout_s, timeout_s),
        )
        self.shared_memory = shared_memory
        """Use the daemon's pool directly when it offers it and this process can map it."""
        # copy_threads: how many threads a large shared-memory copy is split over.
        # staged_puts: a stream of shared-memory puts is one round trip each, into
        # pool slots staged for it (shm.py); False: every put is alloc+commit.
        self._mapping = shm.Mapping(copy_threads, staged_puts)

    # -- lifecycle -----------------------------------------------------------------
    def close(self) -> None:
        self._let_go()
        self._unmap()
        self._close_socket()

    def _let_go(self) -> None:
        """Release the staged slots (and unsettled write leases) this client holds in
        the daemon's pool, so they do not wait for their lease to lapse."""
        pool = self._mapping.pool
        leases = shm.parting(pool) if pool is not None else []
        if leases and self._sock is not None:
            try:
                self._run(calls.release(leases), min(self.timeout_s, 1.0))
            except ClientError:
                pass  # the leases expire by themselves

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def failures(self) -> int:
        """Requests that found the daemon unreachable (answered fail-open or raised)."""
        return self._fail.failures

    @property
    def busy_replies(self) -> int:
        """Requests the daemon answered BUSY (a miss when failing open)."""
        return self._fail.busy_replies

    @property
    def short_circuited(self) -> int:
        """Data ops answered as a miss by the open circuit breaker, without a request."""
        return self._fail.short_circuited

    @property
    def fail_open_stats(self) -> dict[str, Any]:
        """failures, busy_replies, short_circuited, outages and whether the daemon is down now."""
        return self._fail.stats()

    # -- transport -----------------------------------------------------------------
    def _close_socket(self) -> None:
        if self._handshakes is not None:
            self._handshakes.close()
            self._handshakes = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _reset(self) -> None:
        self._close_socket()
        self._sock, self._handshakes = new_dealer(self._ctx, self.address, self._hwm, self._curve, watch=True)

    def _roundtrip(self, frames: list[Any], request_id: int, timeout_s: float) -> tuple[Any, list[Any]]:
        if self._sock is None:
            raise RuntimeError("client is closed")
        sock = self._sock
        deadline = time.monotonic() + timeout_s
        big = any(memoryview(f).nbytes >= COPY_THRESHOLD for f in frames[1:])
        while True:
            try:
                tracker = sock.send_multipart(frames, zmq.NOBLOCK, copy=not big, track=big)
                break
            except zmq.Again:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sock.poll(int(remaining * 1000) + 1, zmq.POLLOUT):
                    raise unavailable(f"no connection to {self.address}", self._handshakes) from None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sock.poll(int(remaining * 1000) + 1, zmq.POLLIN):
                self._abandon(tracker, timeout_s)
                raise unavailable(f"no reply from {self.address} within {timeout_s}s", self._handshakes)
            reply_frames = sock.recv_multipart(copy=False)
            try:
                reply = decode_reply(reply_frames[0].buffer)
            except ValueError:
                logger.warning("dropping a reply that is not protocol v1")
                continue
            # The socket is replaced after every timeout, so nothing stale arrives
            # here; an error reply without id (header unreadable) is ours too.
            if reply.id == request_id or (reply.id is None and not reply.ok):
                return reply, [f.buffer for f in reply_frames[1:]]

    def _abandon(self, tracker: zmq.MessageTracker | None, timeout_s: float) -> None:
        """After a timeout: make sure zmq no longer reads the caller's buffers."""
        if tracker is not None and not tracker.done:
            try:
                tracker.wait(timeout_s)
            except zmq.NotDone:
                logger.warning("a zero-copy send to %s is still pending; resetting the socket", self.address)
        self._reset()

    def _run(self, call: Call[T], timeout_s: float | None = None) -> T:
        if self._breaker_says_miss(call):
            return self._fail.short_circuit(call)
        request_id = next(self._ids) & (2**64 - 1)
        frames = encode_request(call.op, request_id, call.namespace, call.keys, call.payloads, **call.fields)
        try:
            reply, payloads = self._roundtrip(frames, request_id, timeout_s or self.timeout_s)
        except DaemonUnavailable as err:
            return self._fail.failed(call, err)
        return self._fail.answered(call, reply, payloads)

    def _breaker_says_miss(self, call: Call[Any]) -> bool:
        """Whether the open breaker answers ``call`` as a miss (probing first when due)."""
        gate = self._fail.gate(call)
        if gate == MISS:
            return True
        if gate == PROBE:
            request_id = next(self._ids) & (2**64 - 1)
            try:
                reply, _ = self._roundtrip(encode_request(Op.PING, request_id), request_id, self._fail.probe_timeout_s)
            except DaemonUnavailable:
                reply = None
            if not self._fail.probe_answered(reply):
                return True
        return False

    def _ns(self, namespace: Namespace | str | None) -> str:
        ns = namespace_string(namespace) or self.namespace
        if not ns:
            raise ValueError("no namespace: pass namespace= here or to the client")
        return ns

    # -- shared memory (see shm.py) ------------------------------------------------
    @property
    def uses_shared_memory(self) -> bool:
        """Whether data ops go through the daemon's mapped pool (probes the daemon once)."""
        try:
            return self._shared_pool() is not None
        except DaemonUnavailable:
            return False

    def _shared_pool(self) -> SharedPool | None:
        """The mapped pool, None when not offered or not mappable; raises
        DaemonUnavailable when the daemon cannot be asked (asked again next time)."""
        if not self.shared_memory:
            return None
        if not self._mapping.probed:
            try:
                offer = self._run(calls.hello("lmcache-client-py")).get("shm")
            except ServerError:
                offer = None
            return self._mapping.adopt(offer)
        return self._mapping.pool

    @property
    def _pool(self) -> SharedPool | None:
        return self._mapping.pool

    def _unmap(self) -> None:
        self._mapping.drop()

    def _tell(self, call: Call[Any]) -> None:
        """Send without waiting for the reply (the next round trip drops it)."""
        if self._sock is None:
            return
        request_id = next(self._ids) & (2**64 - 1)
        frames = encode_request(call.op, request_id, call.namespace, call.keys, call.payloads, **call.fields)
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            pass  # the lease expires by itself

    def _drive(self, flow: shm.Flow) -> Any:
        """Run a flow's calls; a call's error is raised inside the flow (which may clean
        up and re-raise it)."""
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = flow.throw(error) if error is not None else flow.send(value)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            if isinstance(step, shm.Tell):
                self._tell(step.call)
            else:
                try:
                    value = self._run(step.call)
                except ClientError as err:
                    error = err

    def _over_shm(self, flow: Callable[[SharedPool], shm.Flow], fallback: Callable[[], T], miss: Callable[[], T]) -> T:
        """Run a shared-memory flow; a daemon that restarted (new segment) is
        mapped again, and a daemon that no longer shares its pool gets frames."""
        data_call: Call[T] = Call(Op.PING, _unused_parse, miss=miss)  # stands for the op in the breaker
        if self._breaker_says_miss(data_call):
            return self._fail.short_circuit(data_call)
        for _ in range(2):
            try:
                pool = self._shared_pool()
                if pool is None:
                    return fallback()
                result: T = self._drive(flow(pool))
                return result
            except (ServerError, DaemonUnavailable) as err:
                action = shm.on_failure(err, self._fail.enabled)
                if action == shm.REMAP:
                    self._unmap()
                    continue
                if action == shm.MISS:
                    return miss()
                raise
        return fallback()

    def pin_shared_pool(self) -> bool:
        """Page-lock this process's mapping of the daemon's pool for CUDA DMA
        (``cudaHostRegister``); False when there is no mapped pool or CUDA refuses."""
        pool = self._shared_pool() if self.shared_memory else None
        return pool.register_cuda() if pool is not None else False

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
        return self._over_shm(
            lambda pool: shm.put_flow(pool, ns, keys, payloads, tokens),
            lambda: self._run(call),
            lambda: [PutStatus.FAILED] * len(keys),
        )

    def get(self, keys: Sequence[bytes], *, namespace: Namespace | str | None = None) -> list[Any | None]:
        """One read-only buffer (memoryview) per key, None for a miss.

        On the daemon's host the bytes are copied once out of its pool."""
        ns = self._ns(namespace)
        return self._over_shm(
            lambda pool: shm.get_flow(pool, ns, keys, None),
            lambda: self._run(calls.get(ns, keys)),
            lambda: [None] * len(keys),
        )

    def lookup(self, keys: Sequence[bytes], *, namespace: Namespace | str | None = None) -> LookupResult:
        """How many leading keys are cached, and the tier holding each key."""
        return self._run(calls.lookup(self._ns(namespace), keys))

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
        """Keep these chunks from eviction until unpinned (False: not stored)."""
        return self._run(calls.pin(self._ns(namespace), keys))

    def unpin(self, keys: Sequence[bytes], *, namespace: Namespace | str | None = None) -> list[bool]:
        return self._run(calls.unpin(self._ns(namespace), keys))

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

        return self._over_shm(
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
    ) -> list[PutStatus | int]:
        """Store ``len(keys)`` payloads that ``fill(i, view)`` writes into ``view``
        (writable, ``sizes[i]`` bytes): over shared memory straight into the
        daemon's pool slot (one copy in all, the caller's), else into a buffer
        then sent.  ``fill`` is not called for keys that need no bytes (already
        stored, no room); an exception from it stores none of the batch.
        ``tokens`` as for :meth:`put`."""
        ns = self._ns(namespace)
        if len(sizes) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes")

        def frames() -> list[PutStatus | int]:
            bufs = [bytearray(n) for n in sizes]
            for i, buf in enumerate(bufs):
                fill(i, memoryview(buf))
            return self._run(calls.put(ns, keys, bufs, tokens))

        return self._over_shm(
            lambda pool: shm.fill_flow(pool, ns, keys, sizes, fill, tokens),
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
    ) -> list[bool]:
        """Call ``use(i, view)`` for each hit with its bytes (over shared memory the
        leased pool slot itself: do not keep ``view``); True where ``use`` ran on
        bytes that stayed valid throughout.  ``nbytes``: a hit of another size is a
        miss; ``prefix``: stop at the first miss."""
        ns = self._ns(namespace)

        def frames() -> list[bool]:
            bufs: list[Any] = self._run(calls.get(ns, keys))
            return shm.use_frames(bufs, use, nbytes=nbytes, prefix=prefix)

        return self._over_shm(
            lambda pool: shm.use_flow(pool, ns, keys, use, nbytes=nbytes, prefix=prefix),
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

        return self._over_shm(
            lambda pool: shm.get_flow(pool, ns, keys, out),
            frames,
            lambda: [False] * len(keys),
        )
