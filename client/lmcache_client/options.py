"""One client's options: the record both clients (sync and asyncio) build their parts from.

:class:`~lmcache_client.client.CacheClient` and
:class:`~lmcache_client.aio.AsyncCacheClient` keep their keyword arguments
(engines and users call them); each constructor turns them into one frozen
:class:`ClientOptions` and builds its connection and its shared-memory path
from it, so the two clients cannot drift apart in what an option means.

Primitives: :class:`ClientOptions` (with :meth:`~ClientOptions.breaker`, the
fail-open breaker an option set asks for), :func:`request_ids`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterator

from .curve import CurveKeys
from .failopen import DEFAULT_BACKOFF_S, DEFAULT_MAX_BACKOFF_S, DEFAULT_PROBE_TIMEOUT_S, FailOpen
from .namespace import Namespace


@dataclasses.dataclass(frozen=True)
class ClientOptions:
    """What a client was asked to be (its constructor's arguments, parsed once)."""

    address: str
    namespace: str | None
    """The default namespace of data ops, as its wire string."""
    chunk_size: int | None
    """Tokens per chunk (given, or the Namespace's), for ``lookup_tokens``."""
    timeout_s: float
    """A request's timeout (the connection's starting value: tests and adapters may lower it)."""
    fail_open: bool
    hwm: int
    shared_memory: bool
    """Use the daemon's pool directly when it offers it and this process can map it."""
    copy_threads: int
    """How many threads a large shared-memory copy is split over."""
    staged_puts: bool
    """A stream of shared-memory puts is one round trip each, into pool slots staged
    for it (:mod:`lmcache_client.shm`); False: every put is alloc+commit."""
    curve: CurveKeys | None
    """auth: curve daemons: the daemon's public key and this client's secret key
    (each given as Z85 text or a key file path; docs/security.md)."""
    client_name: str
    """The name this client gives in the hello that probes for the shared pool."""
    backoff_s: float = DEFAULT_BACKOFF_S
    max_backoff_s: float = DEFAULT_MAX_BACKOFF_S
    probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S
    max_outstanding: int = 128
    """Requests in flight at once (the asyncio client's bound)."""

    @classmethod
    def parse(
        cls,
        address: str,
        namespace: Namespace | str | None,
        *,
        timeout_s: float,
        fail_open: bool,
        chunk_size: int | None,
        hwm: int,
        shared_memory: bool,
        copy_threads: int,
        staged_puts: bool,
        server_public_key: str | None,
        client_secret_key: str | None,
        client_name: str,
        backoff_s: float = DEFAULT_BACKOFF_S,
        max_backoff_s: float = DEFAULT_MAX_BACKOFF_S,
        probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
        max_outstanding: int = 128,
    ) -> ClientOptions:
        """The record of a client's keyword arguments: the namespace as its wire
        string, the chunk size given or the Namespace's, the CURVE keys loaded."""
        return cls(
            address=address,
            namespace=namespace.wire() if isinstance(namespace, Namespace) else namespace,
            chunk_size=chunk_size or (namespace.chunk_size if isinstance(namespace, Namespace) else None),
            timeout_s=timeout_s,
            fail_open=fail_open,
            hwm=hwm,
            shared_memory=shared_memory,
            copy_threads=copy_threads,
            staged_puts=staged_puts,
            curve=CurveKeys.from_options(server_public_key, client_secret_key),
            client_name=client_name,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
            probe_timeout_s=probe_timeout_s,
            max_outstanding=max_outstanding,
        )

    def breaker(self) -> FailOpen:
        """A fresh fail-open breaker for these options (a probe never waits past ``timeout_s``)."""
        return FailOpen(
            self.fail_open,
            self.address,
            backoff_s=self.backoff_s,
            max_backoff_s=self.max_backoff_s,
            probe_timeout_s=min(self.probe_timeout_s, self.timeout_s),
        )


def request_ids() -> Iterator[int]:
    """A client's request ids: from a random start, so two clients rarely share one."""
    return itertools.count(int.from_bytes(os.urandom(4), "little") << 20)
