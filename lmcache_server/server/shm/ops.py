"""The shared-memory ops: a get under a read lease, alloc, commit (with
staging), bind and release.

The payloads of these ops never cross the socket: the client reads and writes
the pool itself, under the leases of leases.py, and the replies carry pool
locations.  :class:`.handlers.Handlers` builds one :class:`ShmOps` and hands
it these ops; it also bounds what shared-memory writers may hold reserved
(``reserve_cap``, ``stage_cap``).

Primitives: :class:`ShmOps` (``get``, ``alloc``, ``commit``, ``bind``,
``release``) and ``STAGED_SHARE``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from lmcache_client.protocol import ErrorCode, ProtocolError, PutStatus, Request

from ...config import ServerConfig
from ...storage import Chunk, TieredStore
from ...storage.memory import Reservation
from ...storage.tenants import tenant_of
from ..inflight import ByteBudget
from ..outcome import Outcome, namespace_of, reply_cap
from ..tokens import parse_tokens
from .leases import ShmLeases

STAGED_SHARE = 32
"""Staged shared-memory slots (all clients together) hold at most 1/STAGED_SHARE of the
pool: room held for puts that may not come, so it is kept small; it pays most for
small puts anyway (a round trip saved is a larger share of a small put's time)."""


class ShmOps:
    """The shared-memory ops of :class:`.handlers.Handlers` (``shm``: the lease
    table, None when the pool is not shared: every op is refused STALE_SEGMENT)."""

    def __init__(self, store: TieredStore, config: ServerConfig, budget: ByteBudget, shm: ShmLeases | None):
        self.store = store
        self.config = config
        self.budget = budget
        self.shm = shm
        pool = store.memory.allocator.capacity
        self.reserve_cap = min(max(config.max_message_size, pool // 4), pool // 2)
        """Bytes all shared-memory write leases may hold reserved at once."""
        self.stage_cap = pool // STAGED_SHARE
        """Bytes all staged slots together may hold (within reserve_cap)."""

    def _shm(self, request: Request) -> ShmLeases:
        """The lease table, after checking the request names this server's segment."""
        if self.shm is None:
            raise ProtocolError(ErrorCode.STALE_SEGMENT, "shared memory is off on this server", request.id)
        self.shm.check_segment(request.fields.get("shm"), request.id)
        return self.shm

    async def get(self, request: Request, reply_share: Callable[[], int] | None = None) -> Outcome:
        """A get answered with pool locations under a read lease; a hit that is
        not in the pool (no room to promote it) still travels as a payload frame."""
        shm = self._shm(request)
        chunks = await self.store.get_many(namespace_of(request), request.keys)
        leased: list[Chunk] = []
        framed: list[Chunk] = []
        locations: list[list[int] | None] = []
        cap = reply_cap(self.config.max_message_size, reply_share)
        total = trimmed = 0
        for i, chunk in enumerate(chunks):
            if chunk is None:
                locations.append(None)
            elif chunk.offset is not None:
                leased.append(chunk)
                locations.append([chunk.offset, chunk.nbytes])
            elif total + chunk.nbytes <= cap:
                framed.append(chunk)
                total += chunk.nbytes
                locations.append(None)
            else:
                trimmed += total + chunk.nbytes <= self.config.max_message_size
                chunk.release()
                chunks[i] = None
                locations.append(None)
        if not self.budget.try_acquire(total):
            for chunk in leased + framed:
                chunk.release()
            raise ProtocolError(ErrorCode.BUSY, "in-flight byte budget spent; retry", request.id)
        fields: dict[str, Any] = {"found": [c is not None for c in chunks], "loc": locations, "lease": None}
        if leased:
            fields["lease"], fields["expires"] = shm.grant_reads(leased)
        return Outcome(fields, framed, total, shm_out_bytes=sum(c.nbytes for c in leased), trimmed=trimmed)

    async def alloc(self, request: Request) -> Outcome:
        """Reserve pool room for chunks the client will write, under a write lease."""
        shm = self._shm(request)
        sizes = request.fields.get("sizes")
        if (
            not isinstance(sizes, list)
            or len(sizes) != len(request.keys)
            or not all(type(n) is int and n > 0 for n in sizes)
        ):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "'sizes' must list one positive integer per key", request.id)
        tokens = parse_tokens(request)
        nonce, deadline = request.fields.get("nonce"), request.fields.get("deadline")
        if (nonce is not None and type(nonce) is not int) or (
            deadline is not None and type(deadline) not in (int, float)
        ):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, "'nonce' must be an integer, 'deadline' a number (monotonic s)", request.id
            )
        if deadline is not None and time.monotonic() >= deadline:
            raise ProtocolError(ErrorCode.BUSY, "alloc deadline passed before it was served", request.id)
        # One alloc reserves at most max_message_size, as a put carries at most
        # that: a larger chunk is TOO_LARGE, the keys past the total NO_SPACE.
        limit = self.config.max_message_size
        outcomes: list[Reservation | PutStatus] = []
        asked: list[int] = []
        total = 0
        for i, size in enumerate(sizes):
            if size > limit:
                outcomes.append(PutStatus.TOO_LARGE)
            elif total + size > limit:
                outcomes.append(PutStatus.NO_SPACE)
            else:
                total += size
                asked.append(i)
                outcomes.append(PutStatus.NO_SPACE)  # replaced below
        tenant = tenant_of(namespace_of(request))
        self._check_reservation(shm, total, request.id, tenant)
        reserved = await self.store.reserve_waiting(
            namespace_of(request),
            [request.keys[i] for i in asked],
            [sizes[i] for i in asked],
            None if tokens is None else [tokens[i] for i in asked],
        )
        for i, outcome in zip(asked, reserved):
            outcomes[i] = outcome
        reservations = [r for r in outcomes if isinstance(r, Reservation)]
        if reservations and deadline is not None and time.monotonic() >= deadline:
            # The client has given up waiting: a grant now would be a lease nobody knows.
            for r in reservations:
                self.store.abort(r)
            raise ProtocolError(ErrorCode.BUSY, "alloc deadline passed while waiting for room", request.id)
        fields: dict[str, Any] = {
            "status": [int(PutStatus.STORED) if isinstance(r, Reservation) else int(r) for r in outcomes],
            "loc": [[r.offset, r.size] if isinstance(r, Reservation) else None for r in outcomes],
            "lease": None,
        }
        if reservations:
            try:
                fields["lease"], fields["expires"] = shm.grant_writes(
                    reservations, request.fields.get("owner"), nonce=nonce, tenant=tenant
                )
            except ProtocolError as err:
                raise ProtocolError(err.code, str(err), request.id) from None
        return Outcome(fields)

    def _check_reservation(self, shm: ShmLeases, nbytes: int, request_id: int, tenant: str | None = None) -> None:
        """Bound what shared-memory writers may hold reserved (an alloc is in no
        byte budget: its payload never crosses the socket): all write leases
        together (with the slots quarantined after an expiry) at most
        ``reserve_cap`` (one alloc always, when nothing is reserved), so
        allocs can never evict the whole pool and sit on it."""
        reserved = shm.reserved_bytes()
        # Charged to the tenant: one tenant's allocs hold at most half the cap
        # (quarantined slots included), so they cannot make every other tenant BUSY.
        if tenant is not None:
            own = shm.tenant_reserved_bytes(tenant)
            if own and own + nbytes > self.reserve_cap // 2:
                raise ProtocolError(
                    ErrorCode.BUSY,
                    f"tenant {tenant!r} holds {own} bytes of shared-memory write reservations "
                    f"(at most {self.reserve_cap // 2}); retry",
                    request_id,
                )
        # With nothing reserved any one alloc is admitted (it is at most
        # max_message_size): a writer larger than the cap is slow, never starved.
        if reserved and reserved + nbytes > self.reserve_cap:
            raise ProtocolError(
                ErrorCode.BUSY,
                f"shared-memory write reservations spent ({reserved} of {self.reserve_cap} bytes); retry",
                request_id,
            )

    async def commit(self, request: Request) -> Outcome:
        """Make a write lease's chunks visible; one status per reserved chunk.
        With ``stage`` (sizes), also stage slots for the writer's next put (see bind)."""
        shm = self._shm(request)
        stage = self._stage_sizes(request)
        statuses, nbytes = shm.commit(request.fields.get("lease"), request.id)
        fields: dict[str, Any] = {"status": [int(s) for s in statuses]}
        if stage is not None:
            fields["staged"] = None
            # Staged room counts against reserve_cap like any write lease, and is
            # speculative (evicts chunks for a put that may not come), so all of it
            # together stays under 1/32 of the pool; staging is optional: past
            # either cap (or without room) it is declined, not BUSY.
            total = sum(stage)
            if shm.reserved_bytes() + total <= self.reserve_cap and shm.staged_bytes() + total <= self.stage_cap:
                staged = shm.stage(stage, request.fields.get("owner"))
                if staged is not None:
                    lease, rooms, deadline = staged
                    fields["staged"] = {
                        "lease": lease,
                        "slots": [[r.offset, r.size] for r in rooms],
                        "expires": deadline,
                    }
        return Outcome(fields, shm_in_bytes=nbytes)

    def _stage_sizes(self, request: Request) -> list[int] | None:
        """A commit's ``stage`` field: None, or one positive size per slot, at most
        max_keys_per_request slots and max_message_size bytes in all (as one alloc)."""
        stage = request.fields.get("stage")
        if stage is None:
            return None
        if (
            not isinstance(stage, list)
            or not 0 < len(stage) <= self.config.max_keys_per_request
            or not all(type(n) is int and n > 0 for n in stage)
            or sum(stage) > self.config.max_message_size
        ):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                "'stage' must list 1 to max_keys_per_request positive sizes, at most max_message_size in all",
                request.id,
            )
        return stage

    async def bind(self, request: Request) -> Outcome:
        """A put into staged slots in one round trip: bind each key to the slot the
        client wrote (``slots``: one offset per key) and commit; the reply carries
        one status per key, the fresh slots staged in place of those consumed and
        the lease's renewed deadline."""
        shm = self._shm(request)
        lease, slots = request.fields.get("lease"), request.fields.get("slots")
        if type(lease) is not int:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "'lease' must be a staged lease id", request.id)
        if (
            not isinstance(slots, list)
            or len(slots) != len(request.keys)
            or not all(type(o) is int for o in slots)
            or len(set(slots)) != len(slots)
        ):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "'slots' must list one distinct slot offset per key", request.id)
        tokens, namespace = parse_tokens(request), namespace_of(request)
        statuses, fresh, deadline, nbytes = shm.bind(lease, namespace, request.keys, slots, tokens, request.id)
        return Outcome(
            {
                "status": [int(s) for s in statuses],
                "fresh": [[r.offset, r.size] for r in fresh],
                "expires": deadline,
            },
            shm_in_bytes=nbytes,
        )

    async def release(self, request: Request) -> Outcome:
        """End read leases (or abandon write leases); True where the lease was still live."""
        if self.shm is None:
            raise ProtocolError(ErrorCode.STALE_SEGMENT, "shared memory is off on this server", request.id)
        leases = request.fields.get("leases")
        if not isinstance(leases, list) or len(leases) > self.config.max_keys_per_request:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "'leases' must be a list of lease ids", request.id)
        # An alloc's nonce may stand for its lease (a grant the client never saw).
        return Outcome({"released": self.shm.release(leases)})
