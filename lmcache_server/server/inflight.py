"""In-flight limits: bytes and requests being handled, refused with BUSY instead of queueing.

Primitives: :class:`ByteBudget` (``try_acquire``, ``release``, ``share``,
``in_use``), the server-wide byte budget and each holder's fair share of it; :class:`ClientLedger` (``try_acquire``,
``release``, ``hold``, ``unhold``), each client connection's own share of it,
so one greedy client gets BUSY while the others keep being served.
"""

from __future__ import annotations


class ByteBudget:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.in_use = 0

    def try_acquire(self, nbytes: int) -> bool:
        """Take ``nbytes`` if they fit.  An idle budget takes one request of any
        size, so a request larger than the budget is slow, never starved."""
        if self.in_use and self.in_use + nbytes > self.max_bytes:
            return False
        self.in_use += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.in_use -= nbytes
        assert self.in_use >= 0, "byte budget released more than it lent"

    def share(self, held: int) -> int:
        """Bytes more a holder of ``held`` bytes may take: it may hold at most
        half of what the others leave.  So one connection holds at most half
        the budget, two at most three quarters, and however many clients stop
        reading their replies, the rest is never spent by them."""
        others = self.in_use - held
        return max(0, (self.max_bytes - others) // 2 - held)


class ClientLedger:
    """Requests and payload bytes in flight per peer (ZeroMQ routing id).

    A request counts from its acquire until its handler finishes; bytes are a
    put's payload until it is stored, and a get reply's payload until ZeroMQ
    has sent it (a client that stops reading keeps holding them).  As with
    :class:`ByteBudget`, a client holding no bytes is let in whatever its
    request's size.  Entries exist only while something is in flight, so the
    table is bounded by the connections with work in progress.
    """

    def __init__(self, max_requests: int, max_bytes: int):
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self._entries: dict[bytes, list[int]] = {}  # peer -> [requests, bytes]

    def try_acquire(self, peer: bytes, nbytes: int) -> str | None:
        """Count one request of ``nbytes``; None if it fits, else the limit it hit."""
        entry = self._entries.get(peer)
        if entry is None:
            self._entries[peer] = [1, nbytes]
            return None
        requests, held = entry
        if requests >= self.max_requests:
            return "client_requests"
        # max(.., 1): a get (no request payload) waits while the client's
        # unsent replies fill its share.
        if held and held + max(nbytes, 1) > self.max_bytes:
            return "client_bytes"
        entry[0] += 1
        entry[1] += nbytes
        return None

    def release(self, peer: bytes, nbytes: int) -> None:
        """The request acquired with ``nbytes`` is done."""
        self._change(peer, -1, -nbytes)

    def hold(self, peer: bytes, nbytes: int) -> None:
        """A reply of ``nbytes`` payload is being sent to ``peer``."""
        if nbytes:
            entry = self._entries.setdefault(peer, [0, 0])
            entry[1] += nbytes

    def unhold(self, peer: bytes, nbytes: int) -> None:
        if nbytes:
            self._change(peer, 0, -nbytes)

    def _change(self, peer: bytes, requests: int, nbytes: int) -> None:
        entry = self._entries[peer]
        entry[0] += requests
        entry[1] += nbytes
        assert entry[0] >= 0 and entry[1] >= 0, "client ledger released more than it counted"
        if entry == [0, 0]:
            del self._entries[peer]

    def in_flight(self, peer: bytes) -> tuple[int, int]:
        """(requests, bytes) of ``peer`` now."""
        requests, held = self._entries.get(peer, (0, 0))
        return requests, held

    def __len__(self) -> int:
        return len(self._entries)
