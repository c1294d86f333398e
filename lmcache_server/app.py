"""Composition root and lifecycle: build every component, serve, drain, shut down.

startup (pool, tiers, store, metrics, sockets, HTTP) -> serve until SIGTERM or
SIGINT -> drain in-flight requests for ``drain_timeout_s`` -> close everything
-> exit code 0.  With ``warm_restart`` (a supervisor restarts the daemon) the
pool segment left by the last clean stop is adopted at startup, and a clean
stop leaves it, with its index, for the next daemon (storage/memory/warmstart.py);
without it the pool goes at the stop, and one this daemon kept earlier goes at
its start.  Nothing here is global: the registry, the config and the
ZeroMQ context are created here and passed down.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import zmq.asyncio
from prometheus_client import CollectorRegistry

from lmcache_client.memtune import tune_malloc

from .config import ConfigError, ServerConfig, disk_path
from .events import Announcer, EventPublisher, EventSettings
from .events.keep import keep_path
from .events.keep import load as load_kept
from .events.keep import save as save_kept
from .events.remote import RemoteHeld
from .events.snapshot import SnapshotServer
from .metrics import (
    EventsCollector,
    PrefetchCollector,
    ServerMetrics,
    ShmCollector,
    SizingCollector,
    StoreCollector,
    TaskFailureCollector,
)
from .sdnotify import notify
from .security import QueryAccess, Security
from .server.endpointlocks import EndpointLocks, bound_endpoints
from .server.handlers import Handlers
from .server.http import HttpEndpoint
from .server.inflight import ByteBudget
from .server.monitor import ConnectionMonitor
from .server.prefetch import Prefetcher
from .server.query import Query
from .server.shm import ShmLeases
from .server.zmq_server import ZmqServer
from .storage import MemoryPool, MemoryTier, TieredStore, TierLinks
from .storage.disk import DiskTier
from .storage.memory import ALIGNMENT, Adoption, WarmStart, installation_id
from .storage.offload import Offload
from .storage.policy import make_policy
from .storage.remote import RedisTier, state_path_for
from .storage.sizing import Sizing
from .storage.statefiles import StateDir
from .storage.statefiles import resolve as resolve_state_dir
from .storage.tenants import TenantQuotas
from .storage.tiered import StoreGate, sketch_width_for
from .summary import SummaryLog
from .supervisor import Supervisor

logger = logging.getLogger(__name__)

COPY_THREADS = 2
"""Threads for multi-MiB copies and checksums (storage/offload.py): they release the GIL."""


class App:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.registry = CollectorRegistry()
        self.ready = False
        self._stop: asyncio.Event | None = None

    def request_stop(self) -> None:
        """Begin a graceful stop; a repeated signal while stopping is logged and changes nothing."""
        if self._stop is None:
            return
        if self._stop.is_set():
            logger.info("already stopping: the drain and shutdown go on (drain_timeout_s bounds them)")
        self._stop.set()

    async def run(self) -> int:
        """Run until a stop signal; return the process exit code.

        build -> serve (until a stop is asked) -> drain -> hand over.  A failure while
        building propagates with nothing started; from the first bind on, the hand-over
        closes everything whatever happened.
        """
        self._stop = asyncio.Event()
        # Each ipc:// socket is this daemon's before anything is built: a second daemon on
        # the same path refuses here, touching none of the first one's files (its pool,
        # its state files named after the listen addresses, its socket).
        with EndpointLocks.take(bound_endpoints(self.config)):
            d = await self._build()
            stopped = False  # a clean stop: signalled and drained (only then is the pool kept)
            try:
                await self._serve(d)
                await self._drain(d)
                stopped = True
            finally:
                await self._hand_over(d, stopped)
        logger.info("lmcache-server stopped")
        return 0

    async def _build(self) -> _Daemon:
        """Every component, in dependency order: nothing listens yet."""
        c = self.config
        # Exposed endpoints without auth, unsafe key files: refused before anything is allocated.
        security = Security.from_config(c)
        query_access = QueryAccess.from_config(c)  # a refused query_tokens_file: exit 2 before any allocation
        if c.malloc_tuning and not tune_malloc():
            logger.info("malloc tuning not applied (not glibc?)")
        state = _state_dir(c)  # what a clean stop keeps for the next start, never in shm_dir
        warm = warm_start(c, state) if c.shared_memory else None
        if warm is not None and not c.warm_restart:
            _release_kept(warm)  # nothing will adopt it: it would hold the pool's memory for ever
            warm = None
        adoption = warm.find() if warm is not None else None
        pool, adoption = _pool(c, adoption)
        supervisor = Supervisor()  # background loops restart after a failure (logged, counted)
        offload = Offload(COPY_THREADS)  # multi-MiB copies and checksums, off the event loop
        policy = make_policy(c.cache_policy, pool.size, ALIGNMENT)
        # The line from the tiers to the store (which needs them, as they need it): made first.
        links = TierLinks(c.spill_ahead_size if c.local_disk is not None else None)
        memory = MemoryTier(
            pool, int(c.max_local_cpu_size * c.max_pinned_fraction), policy,
            links=links, quotas=TenantQuotas(c.quotas("memory")),
        )  # fmt: skip
        warm_leases = adoption.restore(memory) if adoption is not None else None
        disk = None
        if c.local_disk is not None:
            disk = DiskTier(
                Path(disk_path(c.local_disk)),
                c.max_local_disk_size,
                fsync=c.disk_fsync,
                io_threads=c.disk_io_threads,
                retry_s=c.disk_retry_s,
                max_queue_bytes=c.max_spill_queue_size,
                policy=make_policy(c.cache_policy),
                direct_io=c.disk_direct_io,
                supervisor=supervisor,
                links=links,
                quotas=TenantQuotas(c.quotas("disk")),
                scan_tokens=c.events_endpoint is not None and c.record_tokens,
            )
            await disk.open()
        remote = None
        if c.remote_url is not None:
            remote = RedisTier(
                c.remote_url,
                key_prefix=c.remote_key_prefix,
                ttl_s=c.remote_ttl_s,
                timeout_s=c.remote_timeout_s,
                max_queue_bytes=c.max_remote_queue_size,
                username=c.remote_username,
                password=c.remote_password,
                offload=offload,
                supervisor=supervisor,
                state_path=state_path_for(state),
                links=links,
            )
            await remote.open()
        sizing = Sizing(c.sizing_window_chunks) if c.sizing_window_chunks else None
        context = zmq.asyncio.Context(io_threads=c.zmq_io_threads)
        events = _events(c, context, state)
        store = TieredStore(
            memory, disk, remote, offload=offload, supervisor=supervisor, gate=_gate(c, disk, remote),
            events=events, sizing=sizing, record_tokens=c.record_tokens, links=links,
        )  # fmt: skip
        if remote is not None:  # writes owed to Redis at the last stop, of chunks adopted again
            remote.requeue(store.uplink_again)
        budget = ByteBudget(c.max_inflight_bytes)
        metrics = ServerMetrics(self.registry)
        self.registry.register(StoreCollector(store, lambda: budget.in_use, c.chunk_size))
        if sizing is not None:
            self.registry.register(SizingCollector(sizing.stats))
        self.registry.register(TaskFailureCollector(supervisor.failures))
        prefetcher = Prefetcher(store, budget, supervisor)  # lookups with prefetch: true
        self.registry.register(PrefetchCollector(prefetcher.stats))
        if events is not None:
            if remote is not None and c.events_remote and c.events_encoding == "map":  # the array form: no locality
                events.remote = RemoteHeld(events, remote, max_chunks=c.events_remote_max_chunks,
                                           ttl_s=c.remote_ttl_s, audit_s=c.events_remote_audit_s)  # fmt: skip
                links.hear_remote(events.remote)
            self.registry.register(EventsCollector(events.stats))
        shm = ShmLeases(store, pool, c.shm_lease_timeout_s)
        if warm_leases is not None:
            shm.take_over(*warm_leases)
        if shm.enabled:
            self.registry.register(ShmCollector(shm.stats))
        handlers = Handlers(store, c, budget, shm, prefetcher)
        server = ZmqServer(c, handlers, budget, metrics, context, security, supervisor)
        sweeper = supervisor.spawn("shm_sweeper", shm.run) if shm.enabled else None
        query = _query(c, store, query_access)
        http = HttpEndpoint(c.metrics_host, c.metrics_port, self.registry, lambda: self.ready, query)
        monitor = ConnectionMonitor(metrics)
        summary = SummaryLog(store, metrics, lambda: monitor.connected, c.chunk_size, c.stats_log_interval_s)
        return _Daemon(
            security, warm, pool, supervisor, offload, memory, store, metrics, context, events, shm, server,
            sweeper, http, monitor, summary, prefetcher,
        )  # fmt: skip

    async def _serve(self, d: _Daemon) -> None:
        """Bind, install the signal handlers, say ready, and serve until a stop is asked."""
        c = self.config
        loop = asyncio.get_running_loop()
        assert self._stop is not None
        d.security.start(d.context, d.metrics)  # the ZAP handler exists before any handshake
        d.server.bind()
        if d.events is not None:
            _bind_events(d.events)
            namespaces = sorted({ns for tier in d.store.tiers for ns in tier.namespaces()})
            found = d.store.disk.found_tokens if d.store.disk is not None else []  # what the disk's scan read
            restored = d.events.start(namespaces, load_kept(d.events.keep_path), d.store.where, found)
            found.clear()
            logger.info("KV events: epoch %s, %d chunks announced again", d.events.publisher.publisher_id, restored)
            d.event_loops = _serve_events(d.events, d.supervisor)
        d.monitor.start(d.server.sock)
        if c.metrics_port:
            await d.http.start()
        _on_signal(loop, (signal.SIGTERM, signal.SIGINT), self.request_stop)
        _on_signal(loop, (signal.SIGHUP,), lambda: d.security.reload(d.metrics))
        self.ready = True
        logger.info("lmcache-server ready: %s", c.summary())
        notify("READY=1", f"STATUS=serving on {', '.join(c.listen)}")
        d.summary.start()
        serving = loop.create_task(d.server.serve())
        stopping = loop.create_task(self._stop.wait())
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if serving.done():
            serving.result()  # re-raise what killed the receive loop
        serving.cancel()

    async def _drain(self, d: _Daemon) -> None:
        """Stop taking work; finish in-flight replies and spills within drain_timeout_s."""
        c = self.config
        self.ready = False
        notify("STOPPING=1", "STATUS=draining")
        logger.info("stopping: draining in-flight requests (up to %.1fs)", c.drain_timeout_s)
        deadline = time.monotonic() + c.drain_timeout_s
        if await d.server.drain(c.drain_timeout_s):
            logger.info("drained cleanly")
        else:
            logger.warning("drain timed out; cancelled the rest")
        await d.prefetcher.close()  # optional work: cancelled, not waited for
        if not await d.store.flush(max(0.0, deadline - time.monotonic())):
            logger.warning("drain timed out before every spill reached the disk")

    async def _hand_over(self, d: _Daemon, stopped: bool) -> None:
        """Close everything in order; after a clean stop keep the segment and its warm index."""
        assert self._stop is not None
        # The stop handlers stay until the end: a second SIGTERM during the shutdown (a
        # supervisor repeating itself) must not kill a daemon that is writing its snapshots.
        self.ready = False
        self._stop.set()
        await d.summary.close()
        await d.monitor.close()
        d.server.close()
        d.security.stop()
        if d.sweeper is not None:
            d.sweeper.cancel()
        if d.events is not None and stopped:
            save_kept(d.events.keep_path, d.events.kept())
        if d.warm is not None and stopped and d.pool.shared:
            leases = d.shm.hand_over()
            await d.store.filling.wait()  # nothing of ours writes into the pool past this point
            d.memory.keep_segment = d.warm.save(d.pool, d.memory, leases)
        else:
            d.shm.close()
        await d.http.close()
        await d.prefetcher.close()  # (when the drain did not run) no promotion into a closing store
        await d.store.close()
        if d.events is not None:
            for task in d.event_loops:
                task.cancel()
            d.events.publisher.close()  # after the store: its last removals are sent too
            if d.events.snapshot_server is not None:
                d.events.snapshot_server.close()
        await d.supervisor.close()
        d.offload.close()
        d.context.term()
        d.pool.release_lock()  # last: a kept segment may be adopted from now on
        # What is left is the event loop's and the interpreter's own teardown: a stop signal
        # now would only turn a clean exit into a death by signal.  One call per signal swaps
        # our handler for SIG_IGN; there is no moment with the default (deadly) disposition.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)


@dataclass
class _Daemon:
    """What _build made, for _serve, _drain and _hand_over (one running daemon's parts)."""

    security: Security
    warm: WarmStart | None
    pool: MemoryPool
    supervisor: Supervisor
    offload: Offload
    memory: MemoryTier
    store: TieredStore
    metrics: ServerMetrics
    context: zmq.asyncio.Context
    events: Announcer | None
    shm: ShmLeases
    server: ZmqServer
    sweeper: asyncio.Task[None] | None
    http: HttpEndpoint
    monitor: ConnectionMonitor
    summary: SummaryLog
    prefetcher: Prefetcher
    event_loops: list[asyncio.Task[None]] = field(default_factory=list)


def _on_signal(loop: asyncio.AbstractEventLoop, signals: tuple[int, ...], callback: Callable[[], object]) -> None:
    """Run ``callback`` on the loop when one of ``signals`` arrives.

    A plain ``signal.signal`` handler, not ``loop.add_signal_handler``: removing a loop's
    handler restores the default disposition (death for SIGTERM) before anything else can be
    installed, and a supervisor repeating SIGTERM during the shutdown hit that window.
    """

    def handler(signum: int, frame: object) -> None:
        loop.call_soon_threadsafe(callback)

    for sig in signals:
        signal.signal(sig, handler)


def warm_start(c: ServerConfig, state: StateDir | None = None) -> WarmStart:
    """The warm restarts of the daemon ``c`` configures: its identity and installation
    (also what ``lmcache-server cleanup`` removes).  The installation is the random id
    kept in the state directory (``state``, else the one ``c`` resolves to)."""
    if state is None:
        state = _state_dir(c)
    installation = installation_id(state.root if state is not None else None)
    return WarmStart(c.shm_dir, c.listen, c.max_local_cpu_size, c.warm_restart_max_age_s, installation)


def _release_kept(warm: WarmStart) -> None:
    """With warm_restart off: remove the segment an earlier clean stop of this daemon kept."""
    for kept in warm.remove_kept():
        if kept.removed:
            logger.info(
                "warm_restart is off: removed the pool segment %s (%d MiB of host memory) that an earlier clean "
                "stop of this daemon kept",
                kept.name,
                kept.held_bytes >> 20,
            )
        else:
            logger.warning("warm_restart is off: left the kept pool segment %s: %s", kept.name, kept.reason)


def _pool(c: ServerConfig, adoption: Adoption | None) -> tuple[MemoryPool, Adoption | None]:
    """The memory pool: the adopted segment, or (none, or it cannot be mapped) a new one."""
    mode = 0o600 if c.shm_access == "owner" else 0o660
    if adoption is not None:
        try:
            return MemoryPool(c.max_local_cpu_size, c.pin_memory, c.shm_dir, mode, adopt=adoption.segment), adoption
        except OSError as err:
            logger.warning("warm restart refused, the memory tier starts cold: cannot map the old segment (%s)", err)
    return MemoryPool(c.max_local_cpu_size, c.pin_memory, c.shm_dir if c.shared_memory else None, mode), None


def _gate(c: ServerConfig, disk: DiskTier | None, remote: RedisTier | None) -> StoreGate | None:
    """The lower tiers' gate (docs/storage.md); None when every tier takes every chunk."""
    disk_mode = c.disk_admission if disk is not None else "always"
    remote_mode = c.remote_admission if remote is not None else None
    if disk_mode == "always" and remote_mode in ("always", None):
        return None
    capacity = c.max_local_cpu_size + (c.max_local_disk_size if disk is not None else 0)
    return StoreGate(disk_mode, remote_mode, sketch_width=sketch_width_for(capacity), remote_ttl_s=c.remote_ttl_s)


def _state_dir(c: ServerConfig) -> StateDir | None:
    """The daemon's private state directory (storage/statefiles.py): ``state_dir``
    (refused at start when it is not this user's alone), else the spill directory,
    else the per-user default; None (logged) where an implicit one cannot be made."""
    spill = Path(disk_path(c.local_disk)) if c.local_disk else None
    try:
        return resolve_state_dir(c.state_dir, spill, c.listen)
    except OSError as err:
        raise ConfigError(
            "state_dir", c.state_dir, f"a directory of this user that no other user may write ({err})"
        ) from None


def _events(c: ServerConfig, context: zmq.asyncio.Context, state: StateDir | None) -> Announcer | None:
    """The KV-event announcer and its publisher (docs/events.md), None when events are off."""
    if c.events_endpoint is None:
        return None
    publisher = EventPublisher(
        context,
        c.events_endpoint,
        c.events_replay_endpoint,
        hwm=c.events_hwm,
        replay_bytes=c.events_replay_size,
        batch_max_events=c.events_batch_max_events,
        batch_interval_s=c.events_batch_interval_s,
        heartbeat_s=c.events_heartbeat_s,
    )
    settings = EventSettings(
        c.events_topic,
        c.events_node or socket.gethostname(),
        c.events_block_size,
        c.events_encoding,
        chunk_size=c.chunk_size,
    )
    announcer = Announcer(publisher, settings)
    announcer.keep_path = keep_path(state)
    if c.events_snapshot_endpoint is not None:
        announcer.snapshot_server = SnapshotServer(
            context, c.events_snapshot_endpoint, announcer, timeout_s=c.events_snapshot_timeout_s
        )
    return announcer


def _query(c: ServerConfig, store: TieredStore, access: QueryAccess) -> Query:
    """``POST /query`` (docs/events.md), answered to whom ``access`` allows (docs/security.md)."""
    local = [t for t in (store.memory, store.disk) if t is not None]

    def namespaces() -> list[str]:
        return sorted({ns for tier in local for ns in tier.namespaces()})

    events = store.events
    remote = events.remote_holds if events is not None and store.remote is not None else None
    return Query(store.where, namespaces, c.chunk_size, access, remote=remote)


def _bind_events(events: Announcer) -> None:
    publisher = events.publisher
    try:
        publisher.bind()
    except zmq.ZMQError as err:
        key = "events_endpoint" if publisher.replay_endpoint is None else "events_endpoint/events_replay_endpoint"
        raise ConfigError(key, publisher.endpoint, f"an endpoint this host can bind ({err})") from None
    if events.snapshot_server is not None:
        try:
            events.snapshot_server.bind()
        except zmq.ZMQError as err:
            endpoint = events.snapshot_server.endpoint
            raise ConfigError("events_snapshot_endpoint", endpoint, f"an endpoint this host can bind ({err})") from None


def _serve_events(events: Announcer, supervisor: Supervisor) -> list[asyncio.Task[None]]:
    """The replay, heartbeat and snapshot loops of the events endpoint (docs/events.md)."""
    loops = [
        supervisor.spawn("events_replay", events.publisher.serve_replay),
        supervisor.spawn("events_heartbeat", events.publisher.serve_heartbeat),
    ]
    if events.snapshot_server is not None:
        loops.append(supervisor.spawn("events_snapshot", events.snapshot_server.serve))
    if events.remote is not None:  # TTLs and the audit of what Redis holds (events_remote)
        loops.append(supervisor.spawn("events_remote", events.remote.run))
    return loops
