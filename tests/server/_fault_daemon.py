"""The daemon with one bug injected, for tests/server/test_supervision.py.

A bug cannot be produced by input (that is the point of fixing them), so the
supervision of what a bug would break is tested by planting one:

    python tests/server/_fault_daemon.py FAULT python -m lmcache_server --config PATH

(the daemon fixture's ``prefix``).  FAULT is ``dispatch-assert`` (the client
ledger raises an accounting AssertionError for a put whose payload is 777 bytes) or
``disk-writer`` (the first two spill writes raise RuntimeError).
"""

from __future__ import annotations

import sys
from typing import Any


def _dispatch_assert() -> None:
    from lmcache_server.server import inflight

    acquire = inflight.ClientLedger.try_acquire

    def try_acquire(self: Any, peer: bytes, nbytes: int) -> str | None:
        if nbytes == 777:
            raise AssertionError("client ledger released more than it counted")
        return acquire(self, peer, nbytes)

    inflight.ClientLedger.try_acquire = try_acquire  # type: ignore[method-assign]


def _disk_writer() -> None:
    from lmcache_server.storage.disk import tier as disk

    write = disk.write_record
    calls = [0]

    def write_record(*args: Any, **kwargs: Any) -> int:
        calls[0] += 1
        if calls[0] <= 2:
            raise RuntimeError(f"planted bug in spill write {calls[0]}")
        return write(*args, **kwargs)

    disk.write_record = write_record


FAULTS = {"dispatch-assert": _dispatch_assert, "disk-writer": _disk_writer}

if __name__ == "__main__":
    fault, rest = sys.argv[1], sys.argv[2:]
    FAULTS[fault]()
    from lmcache_server.cli import main

    sys.exit(main(rest[rest.index("-m") + 2 :]))
