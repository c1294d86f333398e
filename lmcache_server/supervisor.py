"""Background tasks that never die silently.

A supervised task runs a coroutine function.  If it raises anything but
``CancelledError`` the failure is logged with its traceback, counted by task
name (``lmcache_background_task_failures_total{task}``), and the function is
started again after a backoff (doubling from ``min_backoff_s`` up to
``max_backoff_s``; back to the minimum after a run of ``healthy_s`` without a
failure).  A function that returns is done and not restarted.  Failures caught
elsewhere (an unexpected error while handling one request) are counted with
:meth:`Supervisor.failed`.

Restarting is the safe choice for every loop of this daemon: each one keeps
its state in the component it serves (the queues, the index), not in the
coroutine, so a fresh run carries on where the failed one stopped.

Primitives: :class:`Supervisor` (``spawn``, ``failed``, ``failures``, ``close``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)


class Supervisor:
    def __init__(self, *, min_backoff_s: float = 0.05, max_backoff_s: float = 5.0, healthy_s: float = 60.0):
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self.healthy_s = healthy_s
        self.failures: dict[str, int] = {}
        """Failures per task name since start (restarts included)."""
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, name: str, run: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        """Run ``run()`` as task ``name`` until it returns or is cancelled, restarting it on failure."""
        task = asyncio.get_running_loop().create_task(self._supervise(name, run), name=f"lmcache:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def failed(self, name: str, err: BaseException) -> None:
        """Count (and log) a failure that was caught where it happened."""
        self.failures[name] = self.failures.get(name, 0) + 1
        logger.error("%s failed (%s: %s); failure %d", name, type(err).__name__, err, self.failures[name],
                     exc_info=err)  # fmt: skip

    async def _supervise(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        backoff = self.min_backoff_s
        while True:
            started = time.monotonic()
            try:
                await run()
                return
            except asyncio.CancelledError:
                raise
            except Exception as err:
                self.failed(name, err)
            if time.monotonic() - started >= self.healthy_s:
                backoff = self.min_backoff_s
            logger.warning("restarting %s in %.2fs", name, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)

    async def close(self) -> None:
        """Cancel every task still running and wait for them."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
