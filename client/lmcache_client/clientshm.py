"""The sync client's same-host data path: the daemon's pool, mapped once, and the flows driven over it.

The first data op asks the daemon (hello) whether it shares its pool and maps
it when it does (:mod:`lmcache_client.shm`); each shared-memory op then drives
a flow's calls over the connection, maps the pool again when the daemon
restarted, falls back to payload frames when it no longer shares it, and
answers a miss when the breaker or a failure says so.

Primitives: :class:`SharedMemoryPath` (the shared-memory half of
:class:`~lmcache_client.client.CacheClient`: ``uses_shared_memory``,
``pin_shared_pool``, ``_over_shm``, ``_drive``, ``_let_go``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from . import calls, shm
from .calls import Call
from .connection import Connection
from .errors import ClientError, DaemonUnavailable, ServerError
from .protocol import Op, Reply
from .shmpool import SharedPool

T = TypeVar("T")


def _unused_parse(reply: Reply, payloads: list[Any]) -> Any:
    raise AssertionError("a breaker stand-in call is never sent")


class SharedMemoryPath(Connection):
    """Mapping the daemon's pool and running the shared-memory flows
    (:class:`~lmcache_client.client.CacheClient` sets ``shared_memory`` and ``_mapping`` up)."""

    shared_memory: bool
    _mapping: shm.Mapping

    def _let_go(self) -> None:
        """Release the staged slots (and unsettled write leases) this client holds in
        the daemon's pool, so they do not wait for their lease to lapse."""
        pool = self._mapping.pool
        leases = shm.parting(pool) if pool is not None else []
        if leases and self._sock is not None:
            try:
                self._run(calls.release(leases), min(self.timeout_s, 1.0))
            except ClientError:
                pass  # the leases expire by themselves

    @property
    def uses_shared_memory(self) -> bool:
        """Whether data ops go through the daemon's mapped pool (probes the daemon once)."""
        try:
            return self._shared_pool() is not None
        except DaemonUnavailable:
            return False

    def _shared_pool(self) -> SharedPool | None:
        """The mapped pool, None when not offered or not mappable; raises
        DaemonUnavailable when the daemon cannot be asked (asked again next time)."""
        if not self.shared_memory:
            return None
        if not self._mapping.probed:
            try:
                offer = self._run(calls.hello("lmcache-client-py")).get("shm")
            except ServerError:
                offer = None
            return self._mapping.adopt(offer)
        return self._mapping.pool

    @property
    def _pool(self) -> SharedPool | None:
        return self._mapping.pool

    def _unmap(self) -> None:
        self._mapping.drop()

    def _drive(self, flow: shm.Flow) -> Any:
        """Run a flow's calls; a call's error is raised inside the flow (which may clean
        up and re-raise it)."""
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = flow.throw(error) if error is not None else flow.send(value)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            if isinstance(step, shm.Tell):
                self._tell(step.call)
            else:
                try:
                    value = self._run(step.call)
                except ClientError as err:
                    error = err

    def _over_shm(self, flow: Callable[[SharedPool], shm.Flow], fallback: Callable[[], T], miss: Callable[[], T]) -> T:
        """Run a shared-memory flow; a daemon that restarted (new segment) is
        mapped again, and a daemon that no longer shares its pool gets frames."""
        data_call: Call[T] = Call(Op.PING, _unused_parse, miss=miss)  # stands for the op in the breaker
        if self._breaker_says_miss(data_call):
            return self._fail.short_circuit(data_call)
        for _ in range(2):
            try:
                pool = self._shared_pool()
                if pool is None:
                    return fallback()
                result: T = self._drive(flow(pool))
                return result
            except (ServerError, DaemonUnavailable) as err:
                action = shm.on_failure(err, self._fail.enabled)
                if action == shm.REMAP:
                    self._unmap()
                    continue
                if action == shm.MISS:
                    return miss()
                raise
        return fallback()

    def pin_shared_pool(self) -> bool:
        """Page-lock this process's mapping of the daemon's pool for CUDA DMA
        (``cudaHostRegister``); False when there is no mapped pool or CUDA refuses."""
        pool = self._shared_pool() if self.shared_memory else None
        return pool.register_cuda() if pool is not None else False
