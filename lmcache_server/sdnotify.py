"""systemd's readiness protocol (``Type=notify``): one datagram to ``$NOTIFY_SOCKET``.

The daemon says ``READY=1`` once its sockets are bound and every tier is open (when
``/readyz`` turns 200), ``STOPPING=1`` when a drain starts, and a ``STATUS=`` line with
each, which ``systemctl status`` shows.  Without ``NOTIFY_SOCKET`` (not started by
systemd with ``Type=notify``) nothing is sent.  A socket that cannot be reached is one
log line, never a failure of the daemon: readiness is systemd's business, serving ours.

Primitives: :func:`notify`.
"""

from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger(__name__)


def notify(*fields: str, environ: dict[str, str] | None = None) -> bool:
    """Send ``fields`` (``"READY=1"``, ``"STATUS=..."``) to systemd; True when sent.
    ``NOTIFY_SOCKET`` is a path, or an abstract socket name written with a leading ``@``."""
    address = (os.environ if environ is None else environ).get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address[0] not in "/@":
        logger.warning("NOTIFY_SOCKET=%r is neither a path nor an abstract name: systemd not told", address)
        return False
    target = "\0" + address[1:] if address[0] == "@" else address
    message = "\n".join(f.replace("\n", " ") for f in fields).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message, target)
    except OSError as err:
        logger.warning("cannot tell systemd %s at %s: %s", fields[0], address, err)
        return False
    return True
