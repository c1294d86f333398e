"""What the Redis uplink still owed Redis when the daemon stopped, kept for the next start.

A clean stop while Redis is down (or behind) would otherwise lose, with the
process, the removals Redis was never told about (a ``clear`` or ``delete``:
after a restart every node would read the removed chunks back from Redis) and
the writes acknowledged to clients but not yet in Redis.  :func:`save` writes
them to one small JSON file (temp file + rename); :func:`load` reads it back
and removes it, so it is replayed once.  The file also names the Redis URL and
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
import os
from pathlib import Path
from typing import Any

from ..base import ChunkKey

logger = logging.getLogger(__name__)

VERSION = 1


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
        path.unlink(missing_ok=True)
        return
    doc = {
        "version": VERSION,
        "target": pending.target,
        "clears": pending.clears,
        "deletes": _keys(pending.deletes),
        "writes": _keys(pending.writes),
    }
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def load(path: Path, target: str) -> Pending | None:
    """The pending work saved at ``path`` for ``target`` (None: none, or unreadable:
    logged); the file is removed either way, so it is replayed once."""
    try:
        raw = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        logger.warning("Redis uplink: cannot read %s (%s); what was pending at the last stop is lost", path, err)
        return None
    try:
        path.unlink()
    except OSError:
        pass
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
