"""The operator's cache API on the wire: ``pin`` (with promotion and its bound) and ``prefetch``.

``delete`` and ``unpin`` are plain store calls (handlers.py) and the listing is
the ``stats`` op with ``ns`` (its ``namespace`` map: chunks and bytes per tier,
pinned chunks and bytes); what needs more than one store call is here:

- ``pin``: the bytes the request would add to the pinned bytes (the extents,
  bytes held in the pool, of chunks memory holds unpinned, plus those a lower
  tier holds, which are promoted first) are checked against the room left to
  pin the namespace's chunks *before* anything is pinned: ``max_pinned_fraction``
  of the memory tier, and of its tenant's memory quota when it has one
  (storage/memory/index.py ``pin_room``).  Over it, the request is refused
  whole with ``PIN_LIMIT``, saying how many bytes it needed, how many are
  left and which bound it met.  Then the chunks on disk or
  in Redis are promoted (as ``prefetch`` does) and every key held in memory is
  pinned.  ``pinned[i]`` is false for a chunk no tier holds, or one the
  in-flight budget or memory had no room to promote.
- ``prefetch``: every chunk of the request a lower tier holds is promoted now,
  in windows under the in-flight budget (:meth:`.prefetch.Prefetcher.promote_now`),
  and the reply comes once they are in memory.

Access: ``pin`` needs ``rw`` on the namespace, ``prefetch`` ``ro`` (as a lookup
with ``prefetch: true``); security/access.py.  Pins live in the memory tier's
index: a clean (warm) restart that adopts the pool keeps them, any other start
begins with none.

Primitives: :class:`CacheApi` (``pin``, ``prefetch``).
"""

from __future__ import annotations

from lmcache_client.protocol import ErrorCode, ProtocolError, Request

from ..storage import ChunkKey, TieredStore
from ..storage.memory import extent_of
from .outcome import Outcome
from .prefetch import Prefetcher


class CacheApi:
    """The ``pin`` and ``prefetch`` handlers over one store and its prefetcher."""

    def __init__(self, store: TieredStore, prefetcher: Prefetcher, max_pinned_fraction: float):
        self.store = store
        self.prefetcher = prefetcher
        self.max_pinned_fraction = max_pinned_fraction

    async def pin(self, request: Request) -> Outcome:
        namespace = _namespace(request)
        memory = self.store.memory
        keys = [ChunkKey(namespace, d) for d in dict.fromkeys(request.keys)]
        in_memory = [cost for cost in map(memory.pin_cost, keys) if cost is not None]
        lower = await self.store.prefetch_sizes(keys)
        adds = sum(in_memory) + sum(map(extent_of, lower.values()))
        room = memory.pin_room(namespace)
        if adds > room.left:
            of = "the memory tier" if room.tenant is None else f"tenant {room.tenant}'s memory quota"
            message = (
                f"pinning these chunks needs {adds} more pinned bytes (held in the pool), {max(room.left, 0)} "
                f"are left of {room.limit} (max_pinned_fraction {self.max_pinned_fraction} of {of}); "
                "nothing was pinned: unpin other chunks or raise max_pinned_fraction"
            )
            raise ProtocolError(ErrorCode.PIN_LIMIT, message, request.id)
        promoted = await self.prefetcher.promote_now(namespace, list(k.digest for k in lower)) if lower else None
        pinned = await self.store.pin(namespace, request.keys)
        return Outcome(
            {
                "pinned": pinned,
                "promoted": promoted.chunks if promoted is not None else 0,
                "promoted_bytes": promoted.bytes if promoted is not None else 0,
            }
        )

    async def prefetch(self, request: Request) -> Outcome:
        namespace = _namespace(request)
        store = self.store
        keys = [ChunkKey(namespace, d) for d in request.keys]
        before = store.memory.peek_many(keys)
        promoted = await self.prefetcher.promote_now(namespace, request.keys)
        after = store.memory.peek_many(keys)
        return Outcome(
            {
                "in_memory": after,
                "was_in_memory": sum(before),
                "promoted": promoted.chunks,
                "promoted_bytes": promoted.bytes,
                # held by a lower tier, not promoted: the budget or memory had no room
                "declined": promoted.asked - promoted.chunks,
            }
        )


def _namespace(request: Request) -> str:
    assert request.namespace is not None  # a keyed op: decode_request checked it
    return request.namespace
