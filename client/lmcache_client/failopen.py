"""Fail-open and the circuit breaker, shared by the sync and asyncio clients.

With ``fail_open`` (the default) a data op whose daemon is down, slow,
draining (``SHUTTING_DOWN``) or ``BUSY`` answers like a miss instead of
raising.  A daemon that is down must not cost every call a full
``timeout_s``, so the first failure *opens* the breaker:

- **open**: for ``backoff_s`` data ops answer their miss at once, without
  touching the socket (counted in ``short_circuited``);
- **half-open**: the next data op after the back-off first sends a ``ping``
  bounded by ``probe_timeout_s``; an answer closes the breaker and the op runs,
  no answer re-opens it for twice the back-off (at most ``max_backoff_s``) and
  the op is a miss.

So an outage costs one ``timeout_s`` when it starts and at most one
``probe_timeout_s`` per back-off period after that, for the whole client,
and hits resume by themselves once the daemon answers again.  Calls without
a miss (admin ops, ``fail_open=False``) are never short-circuited: they run
and raise.  An outage is logged once when it starts and once when it ends.

Primitives: :class:`FailOpen` with ``gate``, ``short_circuit``, ``failed``,
``probe_answered``, ``answered``, ``succeeded``; ``PASS``, ``MISS``, ``PROBE``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, TypeVar

from .calls import Call
from .errors import DaemonUnavailable, ServerError
from .protocol import ErrorCode, Reply

logger = logging.getLogger("lmcache_client.client")
T = TypeVar("T")

PASS, MISS, PROBE = "pass", "miss", "probe"

DEFAULT_BACKOFF_S = 1.0
DEFAULT_MAX_BACKOFF_S = 30.0
DEFAULT_PROBE_TIMEOUT_S = 0.25


class FailOpen:
    """Outage bookkeeping and the breaker of one client."""

    def __init__(
        self,
        enabled: bool,
        address: str,
        *,
        backoff_s: float = DEFAULT_BACKOFF_S,
        max_backoff_s: float = DEFAULT_MAX_BACKOFF_S,
        probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
    ):
        if backoff_s < 0 or max_backoff_s < backoff_s or probe_timeout_s <= 0:
            raise ValueError("need 0 <= backoff_s <= max_backoff_s and probe_timeout_s > 0")
        self.enabled = enabled
        self.address = address
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.probe_timeout_s = probe_timeout_s
        self.failures = 0
        """Requests that found the daemon unreachable, slow or draining."""
        self.busy_replies = 0
        self.short_circuited = 0
        """Data ops answered as a miss by the open breaker, without a request."""
        self.outages = 0
        self._down = False
        self._open_until = 0.0
        self._backoff = backoff_s

    @property
    def is_open(self) -> bool:
        """Whether the daemon is considered down right now."""
        return self._down

    def gate(self, call: Call[Any]) -> str:
        """PASS (send it), MISS (answer ``call.miss()`` now) or PROBE (ping first)."""
        if not self._down or not (self.enabled and call.miss is not None):
            return PASS
        return MISS if time.monotonic() < self._open_until else PROBE

    def short_circuit(self, call: Call[T]) -> T:
        assert call.miss is not None
        self.short_circuited += 1
        return call.miss()

    def _open(self, backoff_s: float) -> None:
        self._open_until = time.monotonic() + backoff_s

    def failed(self, call: Call[T], err: DaemonUnavailable | ServerError) -> T:
        """The daemon did not answer (or is draining): open the breaker; a miss when failing open."""
        self.failures += 1
        if not self._down:
            self._down = True
            self.outages += 1
            self._backoff = self.backoff_s
            if self.enabled:
                consequence = f"serving misses, probing it every {self.backoff_s:g}-{self.max_backoff_s:g}s"
            else:
                consequence = "raising DaemonUnavailable"
            logger.warning("lmcache daemon at %s unavailable (%s); %s", self.address, err, consequence)
        self._open(self._backoff)
        if self.enabled and call.miss is not None:
            return call.miss()
        raise err

    def probe_answered(self, reply: Reply | None) -> bool:
        """The half-open probe's reply (None: none in time).  True closes the breaker;
        no reply or a draining daemon keeps it open, twice as long."""
        if reply is not None and not (not reply.ok and reply.code == ErrorCode.SHUTTING_DOWN):
            self.succeeded()
            return True
        self.failures += 1
        self._backoff = min(self.max_backoff_s, max(self._backoff * 2, self.backoff_s))
        self._open(self._backoff)
        return False

    def busy(self, call: Call[T], err: ServerError) -> T:
        """The daemon answered BUSY: a miss when failing open, else the error."""
        self.busy_replies += 1
        if self.enabled and call.miss is not None:
            return call.miss()
        raise err

    def answered(self, call: Call[T], reply: Reply, payloads: list[Any]) -> T:
        """The result of a call the daemon answered (BUSY and SHUTTING_DOWN per the policy)."""
        try:
            result = call.result(reply, payloads)
        except ServerError as err:
            if err.code == ErrorCode.SHUTTING_DOWN:
                return self.failed(call, err)
            self.succeeded()
            if err.code == ErrorCode.BUSY:
                return self.busy(call, err)
            raise
        self.succeeded()
        return result

    def succeeded(self) -> None:
        if self._down:
            self._down = False
            self._backoff = self.backoff_s
            logger.info("lmcache daemon at %s reachable again", self.address)

    def stats(self) -> dict[str, Any]:
        """Counters for the engine's own stats."""
        return {
            "failures": self.failures,
            "busy_replies": self.busy_replies,
            "short_circuited": self.short_circuited,
            "outages": self.outages,
            "down": self._down,
        }
