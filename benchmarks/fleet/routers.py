"""Which replica serves a request: round-robin, or a prefix-aware router.

Both are benchmark code, not product.  A router answers :meth:`pick` with a replica's
index given each replica's requests in flight, and hears :meth:`sent` once the request
went there.

- :class:`RoundRobin`: replica ``i % n``: the worst case for engine-local prefix caches
  (a conversation's next turn lands on another replica most of the time).
- :class:`PrefixRouter`: remembers which replica was sent which hash blocks and picks
  the replica holding the longest leading run of the request's blocks; ties (no match
  anywhere included) go to the replica with the fewest requests in flight, then the
  lowest index.  It is what a KV-aware router (llm-d, Dynamo) learns from the engines'
  KV events, kept as a history of where each block was sent, with no eviction: the same
  router for every configuration (vLLM alone has no daemon, so the daemon's
  ``POST /query`` or its events cannot be the source for all of them; with a shared
  daemon every replica can load what any other stored, so the router matters less).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .trace import Request


class Router(Protocol):
    name: str

    def pick(self, request: Request, in_flight: Sequence[int]) -> int: ...

    def sent(self, request: Request, replica: int) -> None: ...


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, request: Request, in_flight: Sequence[int]) -> int:
        replica = self._next % len(in_flight)
        self._next += 1
        return replica

    def sent(self, request: Request, replica: int) -> None:
        pass


class PrefixRouter:
    name = "prefix"

    def __init__(self) -> None:
        self._holders: dict[int, set[int]] = {}

    def matched(self, request: Request, replica: int) -> int:
        """Leading blocks of ``request`` that were sent to ``replica`` before."""
        n = 0
        for block in request.blocks:
            if replica not in self._holders.get(block, ()):
                break
            n += 1
        return n

    def pick(self, request: Request, in_flight: Sequence[int]) -> int:
        return max(range(len(in_flight)), key=lambda i: (self.matched(request, i), -in_flight[i], -i))

    def sent(self, request: Request, replica: int) -> None:
        for block in request.blocks:
            self._holders.setdefault(block, set()).add(replica)


ROUTERS = {"round-robin": RoundRobin, "prefix": PrefixRouter}


def make_router(name: str) -> Router:
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; one of {', '.join(ROUTERS)}")
    router: Router = ROUTERS[name]()
    return router
