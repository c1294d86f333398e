"""Batched, validated chunk transfers for the engine adapters.

An adapter moves many equal-sized chunk payloads per request; this module
splits them into requests the daemon accepts (bounded keys and bytes per
message), keeps only a *leading* run of hits on reads (a prefix is usable
only up to its first hole), refuses payloads of the wrong size (never
garbage into a KV cache), and turns every client failure into a miss: a
cache that is down costs a recompute, never a failed inference request.

With a ``codec_layout`` the transfer follows the KV codec the daemon
announces (:mod:`.coded`): payloads are encoded before they are stored and
decoded before a caller sees them, under the codec's own namespace; the
callers' raw payloads and callbacks stay as they are.

Where each op goes (namespace, codec, batch size, failures as misses) is
:mod:`.transferroute`'s :class:`~.transferroute.TransferRoute`: a
:class:`ChunkTransfer` builds one from its arguments and holds it (``route``);
its own attributes ``client``, ``namespace``, ``errors``, ... read the route.

Primitive: :class:`ChunkTransfer` with ``lookup``, ``get_prefix``,
``get_prefix_into``, ``get_prefix_with``, ``put`` and ``put_with`` (the
``_with`` pair hands the bytes in place to a callback: over shared memory the
daemon's pool slots themselves; with a codec a decoded scratch copy).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..client import CacheClient
from ..errors import ClientError
from ..keys import ChunkTokens
from ..namespace import Namespace
from ..protocol import PutStatus
from ..shm import FillFn, FlushFn, UseFn, copy_frame
from .chunklayout import ChunkLayout
from .coded import CodecBinding, CodedChunks
from .transferroute import DEFAULT_MAX_BATCH_BYTES as DEFAULT_MAX_BATCH_BYTES  # re-exported: callers import it here
from .transferroute import DEFAULT_MAX_BATCH_KEYS as DEFAULT_MAX_BATCH_KEYS
from .transferroute import TransferRoute

logger = logging.getLogger(__name__)


class ChunkTransfer:
    """Reads and writes whole chunks of ``chunk_bytes`` bytes in one namespace.

    ``codec_layout``: the payloads' shape (``namespace`` must then be a
    :class:`Namespace`); the transfer then uses the codec the daemon announces
    (asked on first use).  ``lossy_ok=False``: payloads that are not in that
    layout, whose bytes only a lossless codec may encode (a lossy codec
    announced is refused with a log line, and chunks are stored raw).
    ``codec``: a codec spec (``"int8:group=64"``, ``"none"``) that overrides the
    daemon's announcement (an engine-side setting; ValueError if invalid)."""

    def __init__(
        self,
        client: CacheClient,
        namespace: Namespace | str,
        chunk_bytes: int,
        *,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        max_batch_keys: int = DEFAULT_MAX_BATCH_KEYS,
        codec_layout: ChunkLayout | None = None,
        lossy_ok: bool = True,
        codec: str | None = None,
    ):
        self.route = TransferRoute(
            client,
            namespace,
            chunk_bytes,
            max_batch_bytes=max_batch_bytes,
            max_batch_keys=max_batch_keys,
            codec_layout=codec_layout,
            lossy_ok=lossy_ok,
            codec=codec,
        )
        """Where the next op goes (namespace, codec, batch size) and its failures."""

    # -- the route, as the transfer's callers see it ---------------------------------
    @property
    def client(self) -> CacheClient:
        return self.route.client

    @property
    def chunk_bytes(self) -> int:
        return self.route.chunk_bytes

    @property
    def batch_keys(self) -> int:
        """Keys per request."""
        return self.route.batch_keys

    @property
    def raw_namespace(self) -> str:
        """The namespace of raw chunks (the codec's adds ``codec=<tag>``)."""
        return self.route.raw_namespace

    @property
    def namespace(self) -> str:
        """The namespace chunks go to: the codec's once it is known, else the raw one."""
        return self.route.namespace

    @property
    def errors(self) -> int:
        """Client errors turned into misses (daemon down, refused requests)."""
        return self.route.errors

    @property
    def codec_errors(self) -> int:
        """Stored chunks that did not decode (each one a miss)."""
        return self.route.codec_errors

    def binding(self) -> CodecBinding | None:
        """The codec binding (asked from the daemon's hello on first use)."""
        return self.route.binding()

    def wants_tokens(self, tokens: Sequence[ChunkTokens | None] | None = None) -> bool:
        """Whether puts should carry token ids (:meth:`.TransferRoute.wants_tokens`)."""
        return self.route.wants_tokens(tokens)

    # -- ops ---------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], *, prefetch: bool = False) -> int:
        """How many leading ``keys`` the daemon holds (0 when it cannot be asked)."""
        return len(self.lookup_tiers(keys, prefetch=prefetch))

    def lookup_tiers(self, keys: Sequence[bytes], *, prefetch: bool = False) -> list[str]:
        """The tier holding each of the leading ``keys`` the daemon holds.  ``prefetch``:
        the daemon then promotes those on disk or in Redis into memory (docs/protocol.md 5.5)."""
        namespace, _ = self.route.target()
        tiers: list[str] = []
        if namespace is None:
            return tiers
        for start in range(0, len(keys), self.batch_keys):
            batch = keys[start : start + self.batch_keys]
            try:
                result = self.client.lookup(batch, namespace=namespace, prefetch=prefetch)
            except ClientError as err:
                self.route.failed("lookup", err)
                return tiers
            tiers.extend(str(t) for t in result.tiers[: result.hit_chunks])
            if result.hit_chunks < len(batch):
                break
        return tiers

    def cancel_prefetch(self, keys: Sequence[bytes], hits: int) -> None:
        """Give up the prefetches a :meth:`lookup_tiers` of ``keys`` with ``prefetch`` joined
        (it answered ``hits`` leading hits): the same batches, each a lookup with
        ``cancel_prefetch`` (docs/protocol.md 5.5).  Failures are counted, never raised."""
        namespace, _ = self.route.target()
        if namespace is None:
            return
        for start in range(0, min(len(keys), hits + 1), self.batch_keys):
            try:
                self.client.lookup(keys[start : start + self.batch_keys], namespace=namespace, cancel_prefetch=True)
            except ClientError as err:
                self.route.failed("lookup", err)
                return

    def get_prefix(self, keys: Sequence[bytes]) -> list[Any]:
        """Payloads (read-only buffers) of the leading ``keys`` that are stored with the
        right size; stops at the first miss, failure or wrong-sized payload."""
        namespace, coded = self.route.target()
        out: list[Any] = []
        if namespace is None:
            return out
        for start in range(0, len(keys), self.batch_keys):
            batch = keys[start : start + self.batch_keys]
            try:
                bufs = self.client.get(batch, namespace=namespace)
            except ClientError as err:
                self.route.failed("get", err)
                return out
            for buf in bufs:
                if buf is None:
                    return out
                if coded is not None:
                    raw = coded.decode_raw(buf, self.chunk_bytes)
                    if raw is None:
                        return out
                    buf = bytes(raw)
                elif memoryview(buf).nbytes != self.chunk_bytes:
                    logger.warning(
                        "lmcache chunk is %d bytes, expected %d; ignoring it and what follows",
                        memoryview(buf).nbytes,
                        self.chunk_bytes,
                    )
                    return out
                out.append(buf)
        return out

    def get_prefix_into(self, keys: Sequence[bytes], out: Sequence[Any]) -> int:
        """Copy the leading hits of ``keys`` into ``out`` (tensors or writable buffers
        of ``chunk_bytes`` each); returns how many leading destinations hold a hit.

        Over shared memory each chunk goes from the daemon's pool straight into its
        destination: one copy fewer than :meth:`get_prefix` and a copy (with a
        codec: decoded from the pool into the destination).  A chunk of the wrong
        size, or one that does not decode, stops the prefix there."""
        if len(keys) != len(out):
            raise ValueError(f"{len(keys)} keys but {len(out)} destinations")
        namespace, coded = self.route.target()
        if namespace is None:
            return 0
        if coded is not None:
            return self._decode_prefix(keys, namespace, coded, lambda i, frame: coded.decode_into(frame, out[i]))
        done = 0
        for start in range(0, len(keys), self.batch_keys):
            batch = keys[start : start + self.batch_keys]
            dests = out[start : start + len(batch)]
            try:
                hits = self.client.get_into(batch, dests, namespace=namespace)
            except ClientError as err:
                self.route.failed("get", err)
                return done
            except ValueError:  # a stored chunk of another size: find it, keep what leads up to it
                return done + self._copy_prefix(batch, dests)
            for hit in hits:
                if not hit:
                    return done
                done += 1
        return done

    def get_prefix_with(self, keys: Sequence[bytes], use: UseFn, *, flush: FlushFn | None = None) -> int:
        """Call ``use(i, view)`` for the leading hits of ``keys`` (``view``: the chunk's
        ``chunk_bytes`` bytes, valid only during the call); returns how many leading
        keys were used.  A miss, a chunk of the wrong size or a failure ends the run.
        Given a ``flush``, the views stay valid until it is called: once per batch of
        keys, before their leases are released (raw chunks; a decoded chunk lives in
        scratch memory, so ``flush()`` follows each use)."""
        namespace, coded = self.route.target()
        if namespace is None:
            return 0
        if coded is not None:

            def decoded(i: int, frame: memoryview) -> bool:
                raw = coded.decode_raw(frame, self.chunk_bytes)
                if raw is None:
                    return False
                use(i, raw)
                if flush is not None:
                    flush()  # raw is scratch memory: used now
                return True

            return self._decode_prefix(keys, namespace, coded, decoded)
        done = 0
        for start in range(0, len(keys), self.batch_keys):
            batch = keys[start : start + self.batch_keys]

            def shifted(i: int, view: memoryview, at: int = start) -> None:
                use(at + i, view)

            try:
                used = self.client.get_with(
                    batch, shifted, nbytes=self.chunk_bytes, prefix=True, namespace=namespace, flush=flush
                )
            except ClientError as err:
                self.route.failed("get", err)
                return done
            run = next((i for i, u in enumerate(used) if not u), len(used))
            done += run
            if run < len(batch):
                break
        return done

    def _decode_prefix(
        self, keys: Sequence[bytes], namespace: str, coded: CodedChunks, step: Callable[[int, memoryview], bool]
    ) -> int:
        """Run ``step(i, frame)`` (decode and hand on; False: it did not decode) over the
        leading hits of ``keys``, straight from the pool slots over shared memory."""
        done = 0
        for start in range(0, len(keys), self.batch_keys):
            batch = keys[start : start + self.batch_keys]
            bad = [len(batch)]  # the first frame that did not decode ends the run

            def stepped(i: int, frame: memoryview, at: int = start, bad: list[int] = bad) -> None:
                if i < bad[0] and not step(at + i, frame):
                    bad[0] = i

            try:
                used = self.client.get_with(batch, stepped, prefix=True, namespace=namespace)
            except ClientError as err:
                self.route.failed("get", err)
                return done
            run = min(bad[0], next((i for i, u in enumerate(used) if not u), len(used)))
            done += run
            if run < len(batch):
                break
        return done

    def put_with(
        self,
        keys: Sequence[bytes],
        fill: FillFn,
        tokens: Sequence[ChunkTokens] | None = None,
        *,
        flush: FlushFn | None = None,
    ) -> int:
        """Store ``len(keys)`` chunks of ``chunk_bytes`` that ``fill(i, view)`` writes
        in place; returns how many are stored now or were already.  ``tokens``
        (one per key) are sent when the daemon publishes KV events.  With a codec
        ``fill`` writes into scratch memory, and the encoded frame is stored.
        Given a ``flush``, ``fill`` may write the views as late as that call: once
        per batch of keys, before they are committed (with a codec: after each
        chunk, which is encoded at once)."""
        namespace, coded = self.route.target()
        if namespace is None:
            return 0
        if tokens is not None and not self.wants_tokens(tokens):
            tokens = None
        stored = 0
        for start in range(0, len(keys), self.batch_keys):
            batch = keys[start : start + self.batch_keys]
            batch_tokens = None if tokens is None else tokens[start : start + self.batch_keys]

            def shifted(i: int, view: memoryview, at: int = start) -> None:
                fill(at + i, view)

            def now(i: int, view: memoryview) -> None:
                shifted(i, view)
                if flush is not None:
                    flush()  # encoded at once: a deferring fill writes before that

            try:
                if coded is not None:
                    frames = [
                        coded.encode_filled(self.chunk_bytes, functools.partial(now, i)) for i in range(len(batch))
                    ]
                    statuses = self.client.put(batch, frames, namespace=namespace, tokens=batch_tokens)
                else:
                    statuses = self.client.put_with(
                        batch,
                        [self.chunk_bytes] * len(batch),
                        shifted,
                        namespace=namespace,
                        tokens=batch_tokens,
                        flush=flush,
                    )
            except ClientError as err:
                self.route.failed("put", err)
                if tokens is not None:
                    self.route.forget_events()  # a daemon restarted without events refuses them: ask again
                continue
            stored += sum(s in (PutStatus.STORED, PutStatus.EXISTS) for s in statuses)
        return stored

    def get_one_with(self, key: bytes, nbytes: int, use: UseFn) -> bool:
        """Call ``use(0, view)`` with the chunk under ``key`` if it is stored with exactly
        ``nbytes`` bytes (a prompt's partial last chunk); True when it was used."""
        namespace, coded = self.route.target()
        if namespace is None:
            return False
        if coded is not None:

            def decoded(_: int, frame: memoryview) -> bool:
                raw = coded.decode_raw(frame, nbytes)
                if raw is None:
                    return False
                use(0, raw)
                return True

            return self._decode_prefix([key], namespace, coded, decoded) == 1
        try:
            used = self.client.get_with([key], use, nbytes=nbytes, prefix=True, namespace=namespace)
        except ClientError as err:
            self.route.failed("get", err)
            return False
        return bool(used and used[0])

    def put_one_with(self, key: bytes, nbytes: int, fill: FillFn) -> bool:
        """Store one chunk of ``nbytes`` bytes (a prompt's partial last chunk) that
        ``fill(0, view)`` writes in place; True when it is stored now or was already."""
        namespace, coded = self.route.target()
        if namespace is None:
            return False
        try:
            if coded is not None:
                frame = coded.encode_filled(nbytes, lambda view: fill(0, view))
                [status] = self.client.put([key], [frame], namespace=namespace)
            else:
                [status] = self.client.put_with([key], [nbytes], fill, namespace=namespace)
        except ClientError as err:
            self.route.failed("put", err)
            return False
        return status in (PutStatus.STORED, PutStatus.EXISTS)

    def _copy_prefix(self, keys: Sequence[bytes], out: Sequence[Any]) -> int:
        copied = 0
        for buf, dest in zip(self.get_prefix(keys), out):
            try:
                copy_frame(buf, dest)
            except ValueError as err:
                logger.warning("lmcache chunk does not fit its destination (%s); ignoring it and what follows", err)
                break
            copied += 1
        return copied

    def put(self, keys: Sequence[bytes], payloads: Sequence[Any], tokens: Sequence[ChunkTokens] | None = None) -> int:
        """Store payloads; returns how many are stored now or were already.  ``tokens``
        (one per key) are sent when the daemon publishes KV events."""
        if len(keys) != len(payloads):
            raise ValueError(f"{len(keys)} keys but {len(payloads)} payloads")
        namespace, coded = self.route.target()
        if namespace is None:
            return 0
        if tokens is not None and not self.wants_tokens(tokens):
            tokens = None
        stored = 0
        for start in range(0, len(keys), self.batch_keys):
            batch = slice(start, start + self.batch_keys)
            try:
                statuses = self.client.put(
                    keys[batch],
                    [coded.encode(p) for p in payloads[batch]] if coded is not None else payloads[batch],
                    namespace=namespace,
                    tokens=None if tokens is None else tokens[batch],
                )
            except ClientError as err:
                self.route.failed("put", err)
                if tokens is not None:
                    self.route.forget_events()  # a daemon restarted without events refuses them: ask again
                continue
            stored += sum(s in (PutStatus.STORED, PutStatus.EXISTS) for s in statuses)
        return stored
