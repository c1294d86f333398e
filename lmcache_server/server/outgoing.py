"""Zero-copy replies ZeroMQ is still sending.

A get reply sends chunk bytes straight from the memory pool.  Each chunk stays
leased, and its bytes stay counted against the server's byte budget and the
client's ledgers, until ZeroMQ's message tracker says the send is done; then
:meth:`SentReplies.sweep` releases them.  A reply with no tracked frame is
finished at once.

Primitives: :data:`Owners`, :class:`Outgoing`, :class:`SentReplies`, :func:`release`.
"""

from __future__ import annotations

import asyncio

import zmq

from ..storage import Chunk
from .inflight import ByteBudget, ClientLedger

Owners = tuple[tuple[ClientLedger, bytes], ...]
"""The ledgers a request counts in: its connection's, and its client key's when keys are limited."""


def release(owners: Owners, nbytes: int) -> None:
    """The request acquired with ``nbytes`` is done in each of its ledgers."""
    for ledger, owner in owners:
        ledger.release(owner, nbytes)


class Outgoing:
    """One reply being sent: its tracker, the chunks it leases, the bytes it holds."""

    __slots__ = ("tracker", "chunks", "budget_bytes", "owners")

    def __init__(self, tracker: zmq.MessageTracker, chunks: list[Chunk], budget_bytes: int, owners: Owners):
        self.tracker = tracker
        self.chunks = chunks
        self.budget_bytes = budget_bytes
        self.owners = owners


class SentReplies:
    """The replies still being sent, released as their sends complete."""

    def __init__(self, budget: ByteBudget):
        self.budget = budget
        self.pending: list[Outgoing] = []

    def __bool__(self) -> bool:
        return bool(self.pending)

    def start(self, tracker: zmq.MessageTracker, chunks: list[Chunk], budget_bytes: int, owners: Owners) -> Outgoing:
        """A reply about to be sent: its bytes are held in ``owners``' ledgers from now."""
        out = Outgoing(tracker, chunks, budget_bytes, owners)
        for ledger, owner in owners:
            ledger.hold(owner, budget_bytes)
        return out

    def sent(self, out: Outgoing, tracked: bool) -> None:
        """``out`` was handed to ZeroMQ: kept until its tracker is done, or finished now."""
        if tracked:
            self.pending.append(out)
        else:
            self.finish(out)

    def finish(self, out: Outgoing) -> None:
        for chunk in out.chunks:
            chunk.release()
        self.budget.release(out.budget_bytes)
        for ledger, owner in out.owners:
            ledger.unhold(owner, out.budget_bytes)

    async def run(self) -> None:
        """Sweep until cancelled."""
        while True:
            # Releases never delay a reply (only the reuse of leased bytes), so
            # a few milliseconds of lag costs nothing and saves wake-ups.
            await asyncio.sleep(0.005 if self.pending else 0.02)
            if self.pending:
                self.sweep()

    def sweep(self) -> None:
        """Release the replies whose sends are done."""
        pending = []
        failed: Exception | None = None
        for out in self.pending:
            if not out.tracker.done:
                pending.append(out)
                continue
            try:
                self.finish(out)
            except Exception as err:  # an accounting bug: the list must stay consistent anyway
                failed = err
        self.pending = pending
        if failed is not None:
            raise failed

    def close(self) -> None:
        """Release every reply (the socket is closed: nothing more will be sent)."""
        for out in self.pending:
            self.finish(out)
        self.pending.clear()
