"""What a request handler returns: the reply fields and what travels or happens with them,
and the two helpers every handler uses (the request's namespace, the reply cap).

Primitives: :class:`Outcome`, :func:`namespace_of`, :func:`reply_cap`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from lmcache_client.protocol import Request

from ..storage import Chunk


@dataclasses.dataclass
class Outcome:
    fields: dict[str, Any]
    chunks: list[Chunk] = dataclasses.field(default_factory=list)
    budget_bytes: int = 0
    """Bytes taken from the budget for the reply; released once it is sent."""
    shm_in_bytes: int = 0
    """Chunk bytes a shared-memory client wrote into the pool (commit), for the byte counters."""
    shm_out_bytes: int = 0
    """Chunk bytes a shared-memory client may now read from the pool (get under a lease)."""
    trimmed: int = 0
    """Hits answered as misses because the connection's fair share of the budget was spent."""
    after_reply: Callable[[], asyncio.Future[None] | None] | None = None
    """Work to start right after the reply is queued, before any other request
    runs (a put's copy into the pool: it overlaps the client's next transfer).
    It may return a future: the request's bytes stay counted in flight until it is done."""


def namespace_of(request: Request) -> str:
    """The namespace of a data op (decode_request guarantees it has one)."""
    namespace: str | None = request.namespace
    assert namespace is not None
    return namespace


def reply_cap(max_message_size: int, reply_share: Callable[[], int] | None) -> int:
    """Payload bytes a reply may carry: ``max_message_size``, and at most the
    connection's fair share of the budget now (``reply_share()``) when given."""
    return max_message_size if reply_share is None else min(max_message_size, reply_share())
