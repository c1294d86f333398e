"""A client's same-host data path: the daemon's pool, mapped once, and the flows driven over it.

The first data op asks the daemon (hello) whether it shares its pool and maps
it when it does (:class:`~.pool.Mapping`); each shared-memory op then drives
a flow's calls over the client's connection, maps the pool again when the
daemon restarted, falls back to payload frames when it no longer shares it,
and answers a miss when the breaker or a failure says so.

The sync and asyncio clients each hold one path built from their options and
their connection; what the two share is written once here: stepping a flow
(:class:`FlowRun`), what a failed flow leads to (:func:`recover`) and the
leases a closing client gives back (:func:`leases_to_release`).

Primitives: :class:`SharedMemoryPath` (sync), :class:`AsyncSharedMemoryPath`
(asyncio), each with ``uses_shared_memory``, ``shared_pool``, ``pool``,
``unmap``, ``drive``, ``over_shm`` and ``let_go``; :class:`FlowRun`,
:func:`recover`, :func:`leases_to_release`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .. import calls
from ..calls import Call
from ..connection import Connection
from ..errors import ClientError, DaemonUnavailable, ServerError
from ..options import ClientOptions
from ..protocol import Op, Reply
from .flows import MISS, REMAP, Ask, Flow, Tell, on_failure
from .pool import Mapping, SharedPool
from .staged import parting

if TYPE_CHECKING:
    from ..aioconnection import AsyncConnection

T = TypeVar("T")


def _unused_parse(reply: Reply, payloads: list[Any]) -> Any:
    raise AssertionError("a breaker stand-in call is never sent")


class FlowRun:
    """One flow being driven: the next call it asks for, and its result once it returns.

    A driver loops ``step = run.next()`` until it is None (then ``run.result``),
    making each step's call and handing back its answer (:meth:`answer`) or its
    error (:meth:`fail`, raised inside the flow, which may clean up and re-raise)."""

    def __init__(self, flow: Flow):
        self._flow = flow
        self._value: Any = None
        self._error: BaseException | None = None
        self.result: Any = None

    def next(self) -> Ask | Tell | None:
        try:
            step = self._flow.throw(self._error) if self._error is not None else self._flow.send(self._value)
        except StopIteration as stop:
            self.result = stop.value
            return None
        self._value, self._error = None, None
        return step

    def answer(self, value: Any) -> None:
        self._value = value

    def fail(self, error: BaseException) -> None:
        self._error = error


def recover(err: ServerError | DaemonUnavailable, fail_open: bool, mapping: Mapping) -> str:
    """What a client does after a flow failed with ``err`` (:func:`~.flows.on_failure`);
    REMAP has already dropped the mapping, so the next try maps the new segment."""
    action = on_failure(err, fail_open)
    if action == REMAP:
        mapping.drop()
    return action


def leases_to_release(mapping: Mapping) -> list[int]:
    """The staged slots and unsettled write leases a closing client holds in the pool."""
    pool = mapping.pool
    return parting(pool) if pool is not None else []


class SharedMemoryPath:
    """The sync client's mapping of the daemon's pool and the flows it runs over ``connection``."""

    def __init__(self, options: ClientOptions, connection: Connection):
        self.enabled = options.shared_memory
        """Use the daemon's pool directly when it offers it and this process can map it."""
        self._hello_name = options.client_name
        self._conn = connection
        self.mapping = Mapping(options.copy_threads, options.staged_puts)

    @property
    def pool(self) -> SharedPool | None:
        return self.mapping.pool

    def unmap(self) -> None:
        self.mapping.drop()

    def let_go(self) -> None:
        """Release the staged slots (and unsettled write leases) this client holds in
        the daemon's pool, so they do not wait for their lease to lapse."""
        leases = leases_to_release(self.mapping)
        if leases and self._conn.is_open:
            try:
                self._conn.run(calls.release(leases), min(self._conn.timeout_s, 1.0))
            except ClientError:
                pass  # the leases expire by themselves

    def uses_shared_memory(self) -> bool:
        """Whether data ops go through the daemon's mapped pool (probes the daemon once)."""
        try:
            return self.shared_pool() is not None
        except DaemonUnavailable:
            return False

    def shared_pool(self) -> SharedPool | None:
        """The mapped pool, None when not offered or not mappable; raises
        DaemonUnavailable when the daemon cannot be asked (asked again next time)."""
        if not self.enabled:
            return None
        if not self.mapping.probed:
            try:
                offer = self._conn.run(calls.hello(self._hello_name)).get("shm")
            except ServerError:
                offer = None
            return self.mapping.adopt(offer)
        return self.mapping.pool

    def drive(self, flow: Flow) -> Any:
        """Run a flow's calls; a call's error is raised inside the flow."""
        run = FlowRun(flow)
        while (step := run.next()) is not None:
            if isinstance(step, Tell):
                self._conn.tell(step.call)
                continue
            try:
                run.answer(self._conn.run(step.call))
            except ClientError as err:
                run.fail(err)
        return run.result

    def over_shm(self, flow: Callable[[SharedPool], Flow], fallback: Callable[[], T], miss: Callable[[], T]) -> T:
        """Run a shared-memory flow; a daemon that restarted (new segment) is
        mapped again, and a daemon that no longer shares its pool gets frames."""
        data_call: Call[T] = Call(Op.PING, _unused_parse, miss=miss)  # stands for the op in the breaker
        if self._conn.breaker_says_miss(data_call):
            return self._conn.breaker.short_circuit(data_call)
        for _ in range(2):
            try:
                pool = self.shared_pool()
                if pool is None:
                    return fallback()
                result: T = self.drive(flow(pool))
                return result
            except (ServerError, DaemonUnavailable) as err:
                action = recover(err, self._conn.breaker.enabled, self.mapping)
                if action == REMAP:
                    continue
                if action == MISS:
                    return miss()
                raise
        return fallback()

    def pin_shared_pool(self) -> bool:
        """Page-lock this process's mapping of the daemon's pool for CUDA DMA
        (``cudaHostRegister``); False when there is no mapped pool or CUDA refuses."""
        pool = self.shared_pool() if self.enabled else None
        return pool.register_cuda() if pool is not None else False


class AsyncSharedMemoryPath:
    """The asyncio client's mapping of the daemon's pool and the flows it runs over
    ``connection`` (the same flows as :class:`SharedMemoryPath`, each call awaited)."""

    def __init__(self, options: ClientOptions, connection: AsyncConnection):
        self.enabled = options.shared_memory
        self._hello_name = options.client_name
        self._conn = connection
        self.mapping = Mapping(options.copy_threads, options.staged_puts)

    @property
    def pool(self) -> SharedPool | None:
        return self.mapping.pool

    def unmap(self) -> None:
        self.mapping.drop()

    async def let_go(self) -> None:
        """As :meth:`SharedMemoryPath.let_go` (not once the client is closed)."""
        leases = leases_to_release(self.mapping) if not self._conn.closed else []
        if leases:  # staged slots and unsettled write leases: freed now, not at their deadline
            try:
                await self._conn.run(calls.release(leases), min(self._conn.timeout_s, 1.0))
            except ClientError:
                pass

    async def uses_shared_memory(self) -> bool:
        try:
            return await self.shared_pool() is not None
        except DaemonUnavailable:
            return False

    async def shared_pool(self) -> SharedPool | None:
        if not self.enabled:
            return None
        if not self.mapping.probed:
            try:
                offer = (await self._conn.run(calls.hello(self._hello_name))).get("shm")
            except ServerError:
                offer = None
            return self.mapping.adopt(offer)  # another task may have probed meanwhile: kept
        return self.mapping.pool

    async def drive(self, flow: Flow) -> Any:
        run = FlowRun(flow)
        while (step := run.next()) is not None:
            if isinstance(step, Tell):
                await self._conn.tell(step.call)
                continue
            try:
                run.answer(await self._conn.run(step.call))
            except (ClientError, asyncio.CancelledError) as err:  # into the flow: it may clean up
                run.fail(err)
        return run.result

    async def over_shm(
        self,
        flow: Callable[[SharedPool], Flow],
        fallback: Callable[[], Awaitable[T]],
        miss: Callable[[], T],
    ) -> T:
        for _ in range(2):
            try:
                pool = await self.shared_pool()
                if pool is None:
                    return await fallback()
                result: T = await self.drive(flow(pool))
                return result
            except (ServerError, DaemonUnavailable) as err:
                action = recover(err, self._conn.breaker.enabled, self.mapping)
                if action == REMAP:
                    continue
                if action == MISS:
                    return miss()
                raise
        return await fallback()
