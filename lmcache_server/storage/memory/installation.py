"""Who wrote a warm-restart index: this installation of the daemon and this boot of the host.

A kept pool segment is adopted only by the daemon that kept it (storage/memory/warmstart.py):
the same ``listen`` addresses, the same installation (:func:`installation_id`: the user,
the Python environment, and a random id kept in the daemon's private state directory,
not the host name, so a replaced pod or container that keeps its state directory keeps
its pool, and two installations sharing ``/dev/shm`` never take each other's), and the
same boot (:func:`boot_id`: a monotonic deadline means nothing across a reboot).

Primitives: :func:`installation_id`, :func:`boot_id`, :data:`INSTALLATION_FILE`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import socket
import sys
from pathlib import Path

from ..statefiles import read_private, remove, write_private

logger = logging.getLogger(__name__)


INSTALLATION_FILE = "installation-id"
"""In the state directory: this installation's random id (32 hex digits, 0600)."""


def installation_id(state_dir: Path | None = None) -> str:
    """This installation of the daemon: the user, the Python environment it runs from,
    and a random id kept in its private state directory (``state_dir``, or the spill
    directory: :mod:`..statefiles`).  Two installations that share an shm directory and
    listen addresses (containers sharing /dev/shm, a second virtualenv) have two state
    directories, so two ids, and never adopt each other's pool; a replaced container or
    pod that keeps its state directory (a volume) keeps its id, whatever its host name.
    Without a state directory the host name stands in for the id (as before: a new host
    name is another installation)."""
    token = _installation_token(state_dir) if state_dir is not None else None
    if token is None:
        token = "host:" + socket.gethostname()
    raw = f"{os.geteuid()}\0{token}\0{os.path.realpath(sys.prefix)}"
    return hashlib.blake2b(raw.encode(), digest_size=16).hexdigest()


def _installation_token(state_dir: Path) -> str | None:
    """The id kept in ``state_dir`` (made on first use); None, logged, where it can be
    neither read nor made."""
    path = state_dir / INSTALLATION_FILE
    try:
        token = _read_token(path)
        if token is None:
            # Written beside it and linked into place: of two daemons starting at once, one id wins.
            made = path.with_name(f"{INSTALLATION_FILE}.{os.getpid()}")
            with write_private(made) as f:
                f.write(secrets.token_hex(16).encode() + b"\n")
            try:
                os.link(made, path)
            except FileExistsError:
                pass
            finally:
                remove(made, "a temporary installation id")
            token = _read_token(path)
        if token is None:
            raise OSError(f"{path} holds no id after it was written")
        return token
    except OSError as err:
        logger.warning("warm restart: no installation id in %s (%s); the host name stands in for it", state_dir, err)
        return None


def _read_token(path: Path) -> str | None:
    """The id in ``path`` (None: no file, or a damaged one, then removed)."""
    raw = read_private(path, 64)
    if raw is None:
        return None
    token = raw.decode("ascii", "replace").strip()
    if _TOKEN_RE.fullmatch(token):
        return token
    logger.warning("warm restart: %s is damaged; a new installation id replaces it", path)
    remove(path, "the damaged installation id")
    return None


_TOKEN_RE = re.compile(r"[0-9a-f]{32}")


def boot_id() -> str:
    """This boot of the host (a monotonic deadline means nothing across a reboot)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
