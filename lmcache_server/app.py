"""The daemon's lifecycle: build every component, serve, drain, shut down.

startup (:meth:`.daemon.Daemon.build`: pool, tiers, store, metrics, sockets,
HTTP; then bind) -> serve until SIGTERM or SIGINT -> drain in-flight requests
for ``drain_timeout_s`` -> close everything -> exit code 0.  With
``warm_restart`` (a supervisor restarts the daemon) the pool segment left by
the last clean stop is adopted at startup, and a clean stop leaves it, with its
index, for the next daemon (storage/memory/warmstart.py); without it the pool
goes at the stop, and one this daemon kept earlier goes at its start.  Nothing
here is global: the registry, the config and the ZeroMQ context are created
here (and in :mod:`.daemon`) and passed down.

Primitive: :class:`App` (``run``, ``request_stop``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

import zmq
from prometheus_client import CollectorRegistry

from .config import ConfigError, ServerConfig, summary
from .daemon import Daemon
from .events import Announcer
from .events.keep import load as load_kept
from .events.keep import save as save_kept
from .sdnotify import notify
from .server.endpointlocks import EndpointLocks, bound_endpoints
from .supervisor import Supervisor

logger = logging.getLogger(__name__)


class App:
    """One daemon's run: :meth:`run` builds its parts (:class:`.daemon.Daemon`), serves
    until a stop is asked (:meth:`request_stop`, or a signal), drains and hands over."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.registry = CollectorRegistry()
        self.ready = False
        self._stop: asyncio.Event | None = None
        self._event_loops: list[asyncio.Task[None]] = []  # the events endpoint's loops, once serving

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
            d = await Daemon.build(self.config, self.registry, lambda: self.ready)
            stopped = False  # a clean stop: signalled and drained (only then is the pool kept)
            try:
                await self._serve(d)
                await self._drain(d)
                stopped = True
            finally:
                await self._hand_over(d, stopped)
        logger.info("lmcache-server stopped")
        return 0

    async def _serve(self, d: Daemon) -> None:
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
            self._event_loops = _serve_events(d.events, d.supervisor)
        d.monitor.start(d.server.sock)
        if c.metrics_port:
            await d.http.start()
        _on_signal(loop, (signal.SIGTERM, signal.SIGINT), self.request_stop)
        _on_signal(loop, (signal.SIGHUP,), lambda: d.security.reload(d.metrics))
        self.ready = True
        logger.info("lmcache-server ready: %s", summary(c))
        notify("READY=1", f"STATUS=serving on {', '.join(c.listen)}")
        d.summary.start()
        serving = loop.create_task(d.server.serve())
        stopping = loop.create_task(self._stop.wait())
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if serving.done():
            serving.result()  # re-raise what killed the receive loop
        serving.cancel()

    async def _drain(self, d: Daemon) -> None:
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

    async def _hand_over(self, d: Daemon, stopped: bool) -> None:
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
        kept = False  # the pool segment stays for the next daemon: its index was written
        if d.warm is not None and stopped and d.pool.shared:
            leases = d.shm.hand_over()
            await d.store.filling.wait()  # nothing of ours writes into the pool past this point
            kept = d.warm.save(d.pool, d.memory, leases)
        else:
            d.shm.close()
        await d.http.close()
        await d.prefetcher.close()  # (when the drain did not run) no promotion into a closing store
        await d.store.close(keep_segment=kept)
        if d.events is not None:
            for task in self._event_loops:
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
