"""One running daemon's parts, built in dependency order: :class:`Daemon`.

:meth:`Daemon.build` makes every component of a daemon from its config (the pool,
the tiers, the tiered store, metrics, KV events, the shared-memory leases, the
server, the HTTP endpoint, the summary log) and passes each what it uses, in the
order the dependencies run: nothing is assigned onto a part after it is built.
Nothing listens yet; :class:`.app.App` binds, serves, drains and hands the
parts over.  With ``warm_restart`` the pool segment a clean stop left is adopted
here (storage/memory/warmstart.py); without it one this daemon kept earlier is
removed here.

Primitives: :class:`Daemon` (``build``), :func:`warm_start` (also what
``lmcache-server cleanup`` removes).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq.asyncio
from prometheus_client import CollectorRegistry

from lmcache_client.memtune import tune_malloc

from .config import ConfigError, ServerConfig, disk_path, is_mooncake
from .events import Announcer, EventSettings, PublisherSettings, RemoteSettings, SnapshotSettings
from .events.keep import keep_path
from .metrics import (
    EventsCollector,
    PrefetchCollector,
    ServerMetrics,
    ShmCollector,
    SizingCollector,
    StoreCollector,
    TaskFailureCollector,
)
from .security import QueryAccess, Security
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
from .storage.remote import LinkFactory, MooncakeLink, MooncakeSettings, RedisLink, RemoteTier, state_path_for
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


@dataclass
class Daemon:
    """What :meth:`build` made, for the app's serve, drain and hand-over (one running
    daemon's parts)."""

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

    @classmethod
    async def build(cls, c: ServerConfig, registry: CollectorRegistry, ready: Callable[[], bool]) -> Daemon:
        """Every component of the daemon ``c`` configures, in dependency order (nothing
        listens yet); its collectors registered in ``registry``; ``ready`` answers
        ``/healthz``.  A failure propagates with nothing started."""
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
        disk = await _disk(c, supervisor, links)
        remote = await _remote(c, offload, supervisor, links, state, (pool.address, pool.size))
        sizing = Sizing(c.sizing_window_chunks) if c.sizing_window_chunks else None
        context = zmq.asyncio.Context(io_threads=c.zmq_io_threads)
        events = _events(c, context, state, remote)
        if events is not None and events.remote is not None:
            links.hear_remote(events.remote)  # the Redis tier tells it what Redis holds
        store = TieredStore(
            memory, disk, remote, offload=offload, supervisor=supervisor, gate=_gate(c, disk, remote),
            events=events, sizing=sizing, record_tokens=c.record_tokens, links=links,
        )  # fmt: skip
        if remote is not None:  # writes owed to Redis at the last stop, of chunks adopted again
            remote.requeue(store.uplink_again)
        budget = ByteBudget(c.max_inflight_bytes)
        metrics = ServerMetrics(registry)
        registry.register(StoreCollector(store, lambda: budget.in_use, c.chunk_size))
        if sizing is not None:
            registry.register(SizingCollector(sizing.stats))
        registry.register(TaskFailureCollector(supervisor.failures))
        prefetcher = Prefetcher(store, budget, supervisor)  # lookups with prefetch: true
        registry.register(PrefetchCollector(prefetcher.stats))
        if events is not None:
            registry.register(EventsCollector(events.stats))
        shm = ShmLeases(store, pool, c.shm_lease_timeout_s)
        if warm_leases is not None:
            shm.take_over(*warm_leases)
        if shm.enabled:
            registry.register(ShmCollector(shm.stats))
        handlers = Handlers(store, c, budget, shm, prefetcher)
        server = ZmqServer(c, handlers, budget, metrics, context, security, supervisor)
        sweeper = supervisor.spawn("shm_sweeper", shm.run) if shm.enabled else None
        query = _query(c, store, query_access)
        http = HttpEndpoint(c.metrics_host, c.metrics_port, registry, ready, query)
        monitor = ConnectionMonitor(metrics)
        summary = SummaryLog(store, metrics, lambda: monitor.connected, c.chunk_size, c.stats_log_interval_s)
        return cls(
            security, warm, pool, supervisor, offload, memory, store, metrics, context, events, shm, server,
            sweeper, http, monitor, summary, prefetcher,
        )  # fmt: skip


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


async def _disk(c: ServerConfig, supervisor: Supervisor, links: TierLinks) -> DiskTier | None:
    """The disk tier, opened (its index rebuilt from the directory); None without ``local_disk``."""
    if c.local_disk is None:
        return None
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
    return disk


async def _remote(
    c: ServerConfig,
    offload: Offload,
    supervisor: Supervisor,
    links: TierLinks,
    state: StateDir | None,
    pool_region: tuple[int, int] | None = None,
) -> RemoteTier | None:
    """The remote tier on Redis or Mooncake, opened (a store that is down is not a
    failed start); None without ``remote_url``."""
    if c.remote_url is None:
        return None
    if is_mooncake(c.remote_url):
        settings = MooncakeSettings.from_url(
            c.remote_url,
            metadata_server=c.mooncake_metadata_server,
            protocol=c.mooncake_protocol,
            device_name=c.mooncake_device_name,
            local_hostname=c.mooncake_local_hostname,
            segment_size=c.mooncake_segment_size,
            buffer_size=c.mooncake_buffer_size,
            zero_copy=c.mooncake_zero_copy,
        )
        link: LinkFactory = functools.partial(
            MooncakeLink,
            c.remote_url,
            settings,
            key_prefix=c.remote_key_prefix,
            timeout_s=c.remote_timeout_s,
            supervisor=supervisor,
            regions=[pool_region] if pool_region is not None else [],
        )
    else:
        link = functools.partial(
            RedisLink,
            c.remote_url,
            key_prefix=c.remote_key_prefix,
            timeout_s=c.remote_timeout_s,
            username=c.remote_username,
            password=c.remote_password,
            supervisor=supervisor,
        )
    remote = RemoteTier(
        link,
        ttl_s=c.remote_ttl_s,
        max_queue_bytes=c.max_remote_queue_size,
        offload=offload,
        state_path=state_path_for(state),
        links=links,
    )
    await remote.open()
    return remote


def _gate(c: ServerConfig, disk: DiskTier | None, remote: RemoteTier | None) -> StoreGate | None:
    """The lower tiers' gate (docs/storage.md); None when every tier takes every chunk."""
    disk_mode = c.disk_admission if disk is not None else "always"
    remote_mode = c.remote_admission if remote is not None else None
    if disk_mode == "always" and remote_mode in ("always", None):
        return None
    capacity = c.max_local_cpu_size + (c.max_local_disk_size if disk is not None else 0)
    return StoreGate(
        disk_mode,
        remote_mode,
        sketch_width=sketch_width_for(capacity),
        remote_ttl_s=c.remote_ttl_s,
        remote_name=remote.name if remote is not None else "redis",
    )


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


def _events(
    c: ServerConfig, context: zmq.asyncio.Context, state: StateDir | None, remote: RemoteTier | None
) -> Announcer | None:
    """The KV-event announcer and its parts (docs/events.md), None when events are off."""
    if c.events_endpoint is None:
        return None
    publishing = PublisherSettings(
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
    snapshot = None
    if c.events_snapshot_endpoint is not None:
        snapshot = SnapshotSettings(c.events_snapshot_endpoint, c.events_snapshot_timeout_s)
    held = None
    if remote is not None and c.events_remote and c.events_encoding == "map":  # the array form: no locality
        held = RemoteSettings(
            remote, max_chunks=c.events_remote_max_chunks, ttl_s=c.remote_ttl_s, audit_s=c.events_remote_audit_s
        )
    return Announcer(context, settings, publishing, keep_path=keep_path(state), snapshot=snapshot, remote=held)


def _query(c: ServerConfig, store: TieredStore, access: QueryAccess) -> Query:
    """``POST /query`` (docs/events.md), answered to whom ``access`` allows (docs/security.md)."""
    local = [t for t in (store.memory, store.disk) if t is not None]

    def namespaces() -> list[str]:
        return sorted({ns for tier in local for ns in tier.namespaces()})

    events = store.events
    remote = events.remote_holds if events is not None and store.remote is not None else None
    return Query(store.where, namespaces, c.chunk_size, access, remote=remote)
