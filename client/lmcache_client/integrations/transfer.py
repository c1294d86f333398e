"""Batched, validated chunk transfers for the engine adapters.

An adapter moves many equal-sized chunk payloads per request; this module
splits them into requests the daemon accepts (bounded keys and bytes per
message), keeps only a *leading* run of hits on reads (a prefix is usable
only up to its first hole), refuses payloads of the wrong size (never
garbage into a KV cache), and turns every client failure into a miss: a
cache that is down costs a recompute, never a failed inference request.

Primitive: :class:`ChunkTransfer` with ``lookup``, ``get_prefix``,
``get_prefix_into``, ``get_prefix_with``, ``put`` and ``put_with`` (the
``_with`` pair hands the bytes in place to a callback: over shared memory the
daemon's pool slots themselves).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..client import CacheClient
from ..errors import ClientError
from ..keys import ChunkTokens
from ..namespace import Namespace
from ..protocol import PutStatus
from ..shm import FillFn, UseFn, copy_frame

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_BYTES = 64 * 1024 * 1024
"""Payload bytes per get/put request: well under the daemon's 512 MiB default
message cap and its 1 GiB in-flight budget, so several engines fit at once."""
DEFAULT_MAX_BATCH_KEYS = 256


class ChunkTransfer:
    """Reads and writes whole chunks of ``chunk_bytes`` bytes in one namespace."""

    def __init__(
        self,
        client: CacheClient,
        namespace: Namespace | str,
        chunk_bytes: int,
        *,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        max_batch_keys: int = DEFAULT_MAX_BATCH_KEYS,
    ):
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.client = client
        self.namespace = namespace.wire() if isinstance(namespace, Namespace) else namespace
        self.chunk_bytes = chunk_bytes
        self.batch_keys = max(1, min(max_batch_keys, max_batch_bytes // chunk_bytes))
        self.errors = 0
        """Client errors turned into misses (daemon down, refused requests)."""
        self._events: bool | None = None  # whether the daemon publishes KV events (asked once)

    def wants_tokens(self) -> bool:
        """Whether the daemon publishes KV events, so puts should carry token ids
        (its hello offers ``events``; asked once, again after a failed ask)."""
        if self._events is None:
            if self.client.fail_open_stats.get("down"):
                return False  # never a hello past the open breaker: it would wait out timeout_s
            try:
                self._events = bool(self.client.hello().get("events"))
            except ClientError:
                return False
        return self._events

    def _failed(self, op: str, err: ClientError) -> None:
        self.errors += 1
        logger.warning("lmcache %s failed (%s); treating it as a miss", op, err)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the daemon holds (0 when it cannot be asked)."""
        return len(self.lookup_tiers(keys))

    def lookup_tiers(self, keys: Sequence[bytes]) -> list[str]:
        """The tier holding each of the leading ``keys`` the daemon holds."""
        tiers: list[str] = []
        for start in range(0, len(keys), self.batch_keys):
            batch = keys[start : start + self.batch_keys]
            try:
                result = self.client.lookup(batch, namespace=self.namespace)
            except ClientError as err:
                self._failed("lookup", err)
                return tiers
            tiers.extend(str(t) for t in result.tiers[: result.hit_chunks])
            if result.hit_chunks < len(batch):
                break
        return tiers

    def get_prefix(self, keys: Sequence[bytes]) -> list[Any]:
        """Payloads (read-only buffers) of the leading ``keys`` that are stored with the
        right size; stops at the first miss, failure or wrong-sized payload."""
        out: list[Any] = []
        for start in range(0, len(keys), self.batch_keys):
            batch = keys[start : start + self.batch_keys]
            try:
                bufs = self.client.get(batch, namespace=self.namespace)
            except ClientError as err:
                self._failed("get", err)
                return out
            for buf in bufs:
                if buf is None:
                    return out
                if memoryview(buf).nbytes != self.chunk_bytes:
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
        destination: one copy fewer than :meth:`get_prefix` and a copy.  A chunk of
        the wrong size stops the prefix there, as in :meth:`get_prefix`."""
        if len(keys) != len(out):
            raise ValueError(f"{len(keys)} keys but {len(out)} destinations")
        done = 0
        for start in range(0, len(keys), self.batch_keys):
            batch = keys[start : start + self.batch_keys]
            dests = out[start : start + len(batch)]
            try:
                hits = self.client.get_into(batch, dests, namespace=self.namespace)
            except ClientError as err:
                self._failed("get", err)
                return done
            except ValueError:  # a stored chunk of another size: find it, keep what leads up to it
                return done + self._copy_prefix(batch, dests)
            for hit in hits:
                if not hit:
                    return done
                done += 1
        return done

    def get_prefix_with(self, keys: Sequence[bytes], use: UseFn) -> int:
        """Call ``use(i, view)`` for the leading hits of ``keys`` (``view``: the chunk's
        ``chunk_bytes`` bytes, valid only during the call); returns how many leading
        keys were used.  A miss, a chunk of the wrong size or a failure ends the run."""
        done = 0
        for start in range(0, len(keys), self.batch_keys):
            batch = keys[start : start + self.batch_keys]

            def shifted(i: int, view: memoryview, at: int = start) -> None:
                use(at + i, view)

            try:
                used = self.client.get_with(
                    batch, shifted, nbytes=self.chunk_bytes, prefix=True, namespace=self.namespace
                )
            except ClientError as err:
                self._failed("get", err)
                return done
            run = next((i for i, u in enumerate(used) if not u), len(used))
            done += run
            if run < len(batch):
                break
        return done

    def put_with(self, keys: Sequence[bytes], fill: FillFn, tokens: Sequence[ChunkTokens] | None = None) -> int:
        """Store ``len(keys)`` chunks of ``chunk_bytes`` that ``fill(i, view)`` writes
        in place; returns how many are stored now or were already.  ``tokens``
        (one per key) are sent when the daemon publishes KV events."""
        if tokens is not None and not self.wants_tokens():
            tokens = None
        stored = 0
        for start in range(0, len(keys), self.batch_keys):
            batch = keys[start : start + self.batch_keys]

            def shifted(i: int, view: memoryview, at: int = start) -> None:
                fill(at + i, view)

            try:
                statuses = self.client.put_with(
                    batch,
                    [self.chunk_bytes] * len(batch),
                    shifted,
                    namespace=self.namespace,
                    tokens=None if tokens is None else tokens[start : start + self.batch_keys],
                )
            except ClientError as err:
                self._failed("put", err)
                if tokens is not None:
                    self._events = None  # a daemon restarted without events refuses them: ask again
                continue
            stored += sum(s in (PutStatus.STORED, PutStatus.EXISTS) for s in statuses)
        return stored

    def get_one_with(self, key: bytes, nbytes: int, use: UseFn) -> bool:
        """Call ``use(0, view)`` with the chunk under ``key`` if it is stored with exactly
        ``nbytes`` bytes (a prompt's partial last chunk); True when it was used."""
        try:
            used = self.client.get_with([key], use, nbytes=nbytes, prefix=True, namespace=self.namespace)
        except ClientError as err:
            self._failed("get", err)
            return False
        return bool(used and used[0])

    def put_one_with(self, key: bytes, nbytes: int, fill: FillFn) -> bool:
        """Store one chunk of ``nbytes`` bytes (a prompt's partial last chunk) that
        ``fill(0, view)`` writes in place; True when it is stored now or was already."""
        try:
            [status] = self.client.put_with([key], [nbytes], fill, namespace=self.namespace)
        except ClientError as err:
            self._failed("put", err)
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
        if tokens is not None and not self.wants_tokens():
            tokens = None
        stored = 0
        for start in range(0, len(keys), self.batch_keys):
            batch = slice(start, start + self.batch_keys)
            try:
                statuses = self.client.put(
                    keys[batch],
                    payloads[batch],
                    namespace=self.namespace,
                    tokens=None if tokens is None else tokens[batch],
                )
            except ClientError as err:
                self._failed("put", err)
                if tokens is not None:
                    self._events = None  # a daemon restarted without events refuses them: ask again
                continue
            stored += sum(s in (PutStatus.STORED, PutStatus.EXISTS) for s in statuses)
        return stored
