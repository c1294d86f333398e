"""Where a chunk transfer's ops go: the client, the namespace and the KV codec.

A :class:`~.transfer.ChunkTransfer` holds one route; every op starts here: the namespace and
codec path it goes to (with a ``codec_layout``, the codec the daemon announces,
asked from its ``hello`` on first use; :mod:`.coded`), whether puts carry
token ids (the daemon publishes KV events), how many keys one request takes,
and a client failure turned into a counted, logged miss.

Primitives: :class:`TransferRoute` (``target``, ``binding``, ``wants_tokens``,
``forget_events``, ``failed``, ``namespace``, ``codec_errors``, ``errors``),
``DEFAULT_MAX_BATCH_BYTES``, ``DEFAULT_MAX_BATCH_KEYS``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..client import CacheClient
from ..errors import ClientError
from ..keys import ChunkTokens
from ..namespace import Namespace
from .chunklayout import ChunkLayout
from .coded import CodecBinding, CodedChunks

logger = logging.getLogger("lmcache_client.integrations.transfer")  # the transfer's log lines keep their logger name

DEFAULT_MAX_BATCH_BYTES = 64 * 1024 * 1024
"""Payload bytes per get/put request: well under the daemon's 512 MiB default
message cap and its 1 GiB in-flight budget, so several engines fit at once."""
DEFAULT_MAX_BATCH_KEYS = 256


class TransferRoute:
    """The namespace and codec path of a :class:`~.transfer.ChunkTransfer`'s next op,
    and its failures counted as misses (the constructor's arguments are documented
    at :class:`~.transfer.ChunkTransfer`, which builds its route from them)."""

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
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.client = client
        self.raw_namespace = namespace.wire() if isinstance(namespace, Namespace) else namespace
        """The namespace of raw chunks (the codec's adds ``codec=<tag>``)."""
        self.chunk_bytes = chunk_bytes
        self._binding: CodecBinding | None = CodecBinding(self.raw_namespace)
        self._codec_args: tuple[Namespace, ChunkLayout, bool] | None = None
        if codec_layout is not None:
            if not isinstance(namespace, Namespace):
                raise TypeError("a codec_layout needs the namespace as a Namespace")
            if codec_layout.nbytes != chunk_bytes:
                raise ValueError(f"codec_layout holds {codec_layout.nbytes} bytes, chunk_bytes is {chunk_bytes}")
            self._codec_args = (namespace, codec_layout, lossy_ok)
            self._binding = None  # asked on first use
            if codec is not None:
                from ..codec.spec import CodecSpec

                announced = CodecSpec.parse(codec).to_dict()
                self._binding = CodecBinding.resolve(announced, namespace, codec_layout, lossy_ok=lossy_ok)
        self.batch_keys = max(1, min(max_batch_keys, max_batch_bytes // chunk_bytes))
        self.errors = 0
        """Client errors turned into misses (daemon down, refused requests)."""
        self._events: bool | None = None  # whether the daemon publishes KV events (asked once)
        self._chunk_ids: Any = None  # the daemon's chunk_size (its hello's), for token ids

    def wants_tokens(self, tokens: Sequence[ChunkTokens | None] | None = None) -> bool:
        """Whether the daemon publishes KV events, so puts should carry token ids
        (its hello offers ``events``; asked once, again after a failed ask), and,
        given ``tokens``, whether their chunks have the daemon's chunk_size (it
        refuses a put whose ids are another number per chunk)."""
        if self._events is None:
            if self.client.fail_open_stats.get("down"):
                return False  # never a hello past the open breaker: it would wait out timeout_s
            try:
                hello = self.client.hello()
            except ClientError:
                return False
            events = hello.get("events")
            # A daemon older than the tokens frame (docs/protocol.md §5.3) would refuse the put.
            self._events = isinstance(events, dict) and events.get("tokens_frame") is True
            self._chunk_ids = hello.get("chunk_size")
        if self._events and tokens and type(self._chunk_ids) is int:
            first = next((t for t in tokens if t is not None), None)
            return first is None or len(first.packed) == 4 * self._chunk_ids
        return self._events

    @property
    def namespace(self) -> str:
        """The namespace chunks go to: the codec's once it is known, else the raw one."""
        binding = self._binding
        return binding.namespace if binding is not None and binding.namespace is not None else self.raw_namespace

    @property
    def codec_errors(self) -> int:
        """Stored chunks that did not decode (each one a miss)."""
        binding = self._binding
        return binding.coded.errors if binding is not None and binding.coded is not None else 0

    def binding(self) -> CodecBinding | None:
        """The codec binding, asked from the daemon's hello on first use (None while the
        daemon cannot be asked: every op is then a miss)."""
        if self._binding is None and self._codec_args is not None:
            if self.client.fail_open_stats.get("down"):
                # Never a hello past the open breaker (it would wait out timeout_s), but
                # a data op, so that the breaker probes the daemon once its back-off is
                # over: while nothing is bound no other op reaches the client, and the
                # breaker would stay open for good.  Zero keys: nothing is looked up.
                try:
                    self.client.lookup([], namespace=self.raw_namespace)
                except ClientError:
                    return None
                if self.client.fail_open_stats.get("down"):
                    return None
            try:
                hello = self.client.hello()
            except ClientError as err:
                self.failed("hello", err)
                return None
            base, layout, lossy_ok = self._codec_args
            self._binding = CodecBinding.resolve(hello.get("codec"), base, layout, lossy_ok=lossy_ok)
        return self._binding

    def forget_events(self) -> None:
        """Ask again whether the daemon publishes KV events (a put carrying token ids
        failed: a daemon restarted without events refuses them)."""
        self._events = None

    def target(self) -> tuple[str | None, CodedChunks | None]:
        """(namespace, codec path) for the next op; namespace None: a miss, store nothing."""
        binding = self.binding()
        if binding is None:
            return None, None
        return binding.namespace, binding.coded

    def failed(self, op: str, err: ClientError) -> None:
        """Count and log a client failure of ``op``, which the caller answers as a miss."""
        self.errors += 1
        logger.warning("lmcache %s failed (%s); treating it as a miss", op, err)
