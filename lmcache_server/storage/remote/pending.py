"""What the Redis uplink still owed Redis when the daemon stopped, kept for the next start.

A clean stop while Redis is down (or behind) would otherwise lose, with the
process, the removals Redis was never told about (a ``clear`` or ``delete``:
after a restart every node would read the removed chunks back from Redis) and
the writes acknowledged to clients but not yet in Redis.  :func:`save` writes
them to one small JSON file in the daemon's private state directory
(:mod:`..statefiles`: a 0600 temporary file of a random name, then a rename);
:func:`load` reads it back (only a regular file of this user: another user's
file could clear every namespace of the shared Redis) and removes it, so it is
replayed once.  The file also names the Redis URL and
key prefix it was meant for: a daemon pointed at another Redis ignores it.

Removals are replayed before any later write; writes only for the chunks the
new daemon still holds (a warm restart adopted them), the rest is logged as
dropped.  A SIGKILL leaves nothing to replay (the file is written at stop).

Primitives: :class:`Pending`, :func:`save`, :func:`load`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from ..base import ChunkKey
from ..statefiles import read_private, remove, write_private

logger = logging.getLogger(__name__)

VERSION = 1
MAX_BYTES = 256 << 20
"""A pending file is a few keys per write the queue held (at most ``max_remote_queue_size``)."""


@dataclasses.dataclass
class Pending:
    target: str  # the Redis URL (redacted) and key prefix it was meant for
    clears: list[str | None] = dataclasses.field(default_factory=list)  # None: every namespace
    deletes: list[ChunkKey] = dataclasses.field(default_factory=list)
    writes: list[ChunkKey] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.clears or self.deletes or self.writes)


def _keys(keys: list[ChunkKey]) -> list[list[str]]:
    return [[k.namespace, k.digest.hex()] for k in keys]


def save(path: Path, pending: Pending) -> None:
    """Write ``pending`` to ``path`` (or remove the file if nothing is pending)."""
    if not pending:
        remove(path, "the Redis uplink's pending file")
        return
    doc = {
        "version": VERSION,
        "target": pending.target,
        "clears": pending.clears,
        "deletes": _keys(pending.deletes),
        "writes": _keys(pending.writes),
    }
    with write_private(path) as f:
        f.write(json.dumps(doc).encode())


def load(path: Path, target: str) -> Pending | None:
    """The pending work saved at ``path`` for ``target`` (None: none, or unreadable:
    logged); the file is removed either way, so it is replayed once."""
    try:
        raw = read_private(path, MAX_BYTES)
    except OSError as err:
        logger.warning("Redis uplink: cannot read %s (%s); what was pending at the last stop is lost", path, err)
        return None
    if raw is None:
        return None
    remove(path, "the Redis uplink's pending file")
    try:
        doc: Any = json.loads(raw)
        if doc.get("version") != VERSION:
            raise ValueError(f"version {doc.get('version')!r}")
        pending = Pending(
            str(doc["target"]),
            [None if n is None else str(n) for n in doc["clears"]],
            [ChunkKey(str(n), bytes.fromhex(h)) for n, h in doc["deletes"]],
            [ChunkKey(str(n), bytes.fromhex(h)) for n, h in doc["writes"]],
        )
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        logger.warning("Redis uplink: %s is damaged (%s); what was pending at the last stop is lost", path, err)
        return None
    if pending.target != target:
        logger.warning("Redis uplink: %s was left for %s, not %s; ignored", path, pending.target, target)
        return None
    return pending
