"""``lmcache-server cleanup``: free the memory pools kept for a warm restart.

A daemon run with ``warm_restart`` (``--keep-warm``: a supervisor will start it
again) keeps its pool segment and its index in ``shm_dir`` at a clean stop
(storage/memory/warmstart.py).  After a final stop nothing adopts it, and it
holds host memory the size of the pool.  This command removes, for the daemon
the config describes (its ``shm_dir`` and ``listen`` addresses):

- the segments its clean stops kept, with their index (``--all``: those of
  every daemon of this user in that ``shm_dir``, whatever its addresses or
  installation: a pod or container that is gone);
- the segments of this user's daemons that died (no index, no lock held), as
  every daemon start does.

A segment whose lock is held (a running daemon's, or one stopping or adopting
it) is left alone and listed; so are other users' files and other
installations' segments (without ``--all``).  Run it after the daemon stopped for good (the
shipped systemd unit does, on ``systemctl stop``), as the daemon's user and
with its config.

Exit codes: 0 (whatever was left in use), 1 if a segment could not be removed,
2 for a refused configuration.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from .config import ConfigError, load_config, set_overrides
from .daemon import warm_start
from .storage.memory import remove_stale_segments

logger = logging.getLogger("lmcache_server")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmcache-server cleanup",
        description="Remove the memory pool segments kept in shm_dir for a warm restart of this daemon "
        "(after a final stop), and those of daemons that died. Segments in use are left alone.",
    )
    p.add_argument(
        "--config", metavar="PATH", help="the daemon's YAML config (default: $LMCACHE_CONFIG or $LMCACHE_CONFIG_FILE)"
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="set a config key, as for the daemon"
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="every segment kept by a daemon of this user in shm_dir, whatever its listen addresses or "
        "installation (a pod or container that is gone)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config, overrides=set_overrides(args.set))
    except ConfigError as err:
        logger.error("cleanup refused: %s", err)
        return 2
    kept = warm_start(config).remove_kept(every_daemon=args.all)
    failed = False
    for segment in kept:
        who = ", ".join(segment.identity)
        if segment.removed:
            print(f"removed {segment.name} ({segment.held_bytes >> 20} MiB) and its index, kept for {who}")
        else:
            failed |= segment.reason != "in use by a running daemon"
            print(f"left {segment.name} (kept for {who}): {segment.reason}")
    dead = remove_stale_segments(Path(config.shm_dir))
    if dead:
        print(f"removed {dead} segment(s) of daemons that died")
    if not dead and not any(segment.removed for segment in kept):
        print(f"nothing to remove in {config.shm_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
