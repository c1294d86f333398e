"""``lmcache-server --print-config``: the effective config as a YAML file the daemon loads back.

Every key is printed in the spelling its own parser reads back to the same
value (a size in bytes as ``"5GiB"`` or ``"1234567B"``, since a bare number
is GB in LMCache's sense; lists and maps in YAML's own form), so feeding the
output to ``--config`` gives the same :class:`.serverconfig.ServerConfig`.
Secrets are printed as :data:`.configvalues.REDACTED` (``remote_password``,
the password in ``remote_url``, and a ``password`` in its query), which the
loader refuses, naming the key: a copy of the output never carries a secret,
and never loads as if it had one.  Primitives: :func:`config_yaml`.
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from typing import Any

import yaml

from . import __version__
from .configvalues import REDACTED
from .serverconfig import ServerConfig

_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))
_SECRET_QUERY = ("password", "pass", "passwd", "secret", "token")


def _size_text(n: int) -> str:
    """Bytes in the largest binary unit that divides them exactly (``"5GiB"``), else ``"<n>B"``."""
    for unit, factor in _UNITS:
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    return f"{n}B"


def redact_url(url: str) -> str:
    """``url`` with the password of its user part and any secret query argument replaced by the marker."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.partition(':')[0]}:{REDACTED}@{host}"
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    if any(name.lower() in _SECRET_QUERY for name, _ in query):
        hidden = [(name, REDACTED if name.lower() in _SECRET_QUERY else value) for name, value in query]
        parts = parts._replace(query=urllib.parse.urlencode(hidden, safe="<>"))
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _printable(field: dataclasses.Field[Any], value: Any) -> Any:
    """The YAML value that the key's parser reads back as ``value``."""
    if field.name == "tenant_quotas":
        return {
            tenant: {k: _size_text(v) for k, v in (("memory", memory), ("disk", disk)) if v is not None}
            for tenant, memory, disk in value
        }
    if field.name == "kv_codec_params":
        return dict(value)
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, int) and not isinstance(value, bool) and field.metadata["parse"](value) != value:
        return _size_text(value)  # a size: a bare number would be read as GB
    return value


def config_yaml(config: ServerConfig) -> str:
    """The YAML text of ``config``: a header of comments, then every key in the record's order."""
    values = {f.name: _printable(f, getattr(config, f.name)) for f in dataclasses.fields(config)}
    if values["remote_password"] is not None:
        values["remote_password"] = REDACTED
    if values["remote_url"] is not None:
        values["remote_url"] = redact_url(values["remote_url"])
    header = (
        f"# lmcache-server {__version__}: the effective configuration; load it with --config FILE.\n"
        f"# Secrets are redacted as {REDACTED} (remote_password, the password in remote_url), and a\n"
        "# redacted value is refused when this file is loaded: put the secret back, or remove it and\n"
        "# set LMCACHE_REMOTE_PASSWORD.\n"
    )
    body: str = yaml.safe_dump(values, sort_keys=False, default_flow_style=False, allow_unicode=True)
    return header + body
