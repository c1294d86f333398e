"""The value parsers of the config keys (:mod:`.config`): each takes a raw value
(from YAML, an ``LMCACHE_*`` variable or the command line) and returns the typed
value or raises ``ValueError``, which :func:`.config.load_config` turns into a
:class:`.config.ConfigError` naming the key and what was expected.  Also the
helpers other modules use on config values: :func:`parse_size`,
:func:`parse_listen_address`, :func:`redact`, :func:`disk_path`.  A parser raises
:class:`Refused` instead when the value deserves its own explanation (an LMCache
``remote_url`` scheme, a secret that ``--print-config`` redacted).
"""

from __future__ import annotations

import dataclasses
import math
import re
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from .lmcacheconfig import remote_url_advice

REDACTED = "<redacted>"
"""What ``--print-config`` prints for a secret; loading it back is refused (:func:`secret`)."""


class Refused(ValueError):
    """A value refused with its own explanation: ``expected`` replaces the key's usual text."""

    def __init__(self, expected: str):
        super().__init__(expected)
        self.expected = expected


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any) -> int:
    """Bytes from ``40`` / ``2.5`` (GB in LMCache's sense: 2**30 bytes) or ``"40GiB"``, ``"512MB"``, ``"1048576B"``."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not a size")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise ValueError("sizes must be finite and not negative")
        return int(value * 1024**3)
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match:
            number, unit = match.groups()
            factor = _SIZE_UNITS.get(unit.lower())
            if factor is not None:
                return int(float(number) * factor) if unit else int(float(number) * 1024**3)
    raise ValueError("not a size")


def size(minimum: int = 0) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        size = parse_size(value)
        if size < minimum:
            raise ValueError(f"at least {minimum} bytes")
        return size

    return parse


def int_in(lo: int, hi: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ValueError
        return value

    return parse


def float_in(lo: float, hi: float) -> Callable[[Any], float]:
    def parse(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
            raise ValueError
        return float(value)

    return parse


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError


def choice(*options: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if isinstance(value, str) and value.lower() in options:
            return value.lower()
        raise ValueError

    return parse


def optional(inner: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value in (None, "") else inner(value)


def redact(url: str) -> str:
    """The URL without its password, for logs."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.password is None:
        return url
    return urllib.parse.urlunsplit(parsed._replace(netloc=parsed.netloc.replace(f":{parsed.password}@", ":***@")))


def disk_path(url: str) -> str:
    """The directory of ``local_disk``: a bare path as it is, a ``file://`` URL's path
    (``file:///var/cache/x`` -> ``/var/cache/x``)."""
    if url.startswith("/"):
        return url
    parsed = urllib.parse.urlparse(url)
    return urllib.parse.unquote(parsed.netloc + parsed.path) if parsed.netloc else urllib.parse.unquote(parsed.path)


def disk_dir(value: Any) -> str:
    """``local_disk``: a ``file://`` URL, or a bare absolute path as LMCache accepts
    (``/mnt/nvme/lmcache``, kept as written; :func:`disk_path` reads both)."""
    if not isinstance(value, str):
        raise ValueError
    if "," in value:  # LMCache splits a comma-separated list into several disks
        raise Refused("one directory (this daemon's disk tier takes one local_disk path, not a comma-separated list)")
    if value.startswith("/") and "\0" not in value:
        return value
    parsed = urllib.parse.urlparse(value)
    if parsed.scheme != "file" or not parsed.path:
        raise ValueError
    return value


MOONCAKE_SCHEMES = ("mooncake", "mooncakestore")
"""``remote_url`` schemes of a Mooncake Store master (``mooncakestore`` is LMCache's name for it)."""


def is_mooncake(url: str | None) -> bool:
    """Whether a ``remote_url`` names a Mooncake master (else Redis, or no remote tier)."""
    return url is not None and urllib.parse.urlsplit(url).scheme in MOONCAKE_SCHEMES


def redis_url(value: Any) -> str:
    """A ``remote_url``: a Redis URL, or ``mooncake://HOST:PORT`` of a Mooncake master."""
    if not isinstance(value, str):
        raise ValueError
    parsed = urllib.parse.urlparse(value)
    if parsed.scheme in MOONCAKE_SCHEMES:
        if not parsed.hostname or parsed.username or parsed.password or parsed.path not in ("", "/"):
            raise Refused("mooncake://HOST:PORT, the master's address and RPC port (nothing else)")
        _ = parsed.port  # raises ValueError for a port that is not one
        return value
    if parsed.scheme not in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster"):
        advice = remote_url_advice(parsed.scheme)
        if advice is not None:
            raise Refused(f"a redis://, rediss://, unix:// or redis+cluster:// URL, {advice}")
        raise ValueError
    if parsed.password == REDACTED or REDACTED in urllib.parse.unquote(parsed.query):
        raise Refused(_REDACTED_TEXT.format(what="the password in remote_url", env="LMCACHE_REMOTE_PASSWORD"))
    if parsed.scheme == "unix" and not parsed.path:
        raise ValueError
    if parsed.scheme != "unix" and not parsed.hostname:
        raise ValueError
    return value


def mooncake_metadata(value: Any) -> str:
    """Mooncake's metadata server: an http(s):// or etcd:// URL with a host, or P2PHANDSHAKE."""
    if not isinstance(value, str):
        raise ValueError
    if value == "P2PHANDSHAKE":
        return value
    parsed = urllib.parse.urlparse(value)
    if parsed.scheme not in ("http", "https", "etcd") or not parsed.hostname:
        raise ValueError
    return value


def parse_listen_address(value: str) -> str:
    """Validate one ZeroMQ endpoint: ``tcp://HOST:PORT`` or ``ipc:///path``."""
    if value.startswith("ipc://") and len(value) > len("ipc://"):
        return value
    if value.startswith("tcp://"):
        host, sep, port = value[len("tcp://") :].rpartition(":")
        if sep and host and port.isdigit() and 1 <= int(port) <= 65535:
            return value
    raise ValueError


def listen(value: Any) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError
    return tuple(parse_listen_address(str(item).strip()) for item in items)


def events_endpoint(value: Any) -> str:
    """A ZeroMQ endpoint to bind: ``tcp://HOST:PORT`` (HOST may be ``*``) or ``ipc:///path``."""
    if not isinstance(value, str):
        raise ValueError
    return parse_listen_address(value)


def topic(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError
    try:
        value.format(model="m", namespace="n", node="h")
    except (KeyError, IndexError, ValueError):
        raise ValueError from None
    return value


_REDACTED_TEXT = "the secret itself: {what} was redacted by --print-config; put it back, or leave it out and set {env}"


def secret(value: Any) -> str:
    """A secret string (``remote_password``); the redaction marker of ``--print-config`` is refused."""
    if value == REDACTED:
        raise Refused(_REDACTED_TEXT.format(what="it", env="LMCACHE_REMOTE_PASSWORD"))
    return string(value)


def string(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError
    return value


def key_prefix(value: Any) -> str:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise ValueError
    return value


def abs_path(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise ValueError
    return value


def tenant_quotas(value: Any) -> tuple[tuple[str, int | None, int | None], ...]:
    """``{tenant: {memory: SIZE, disk: SIZE}}`` -> sorted (tenant, memory, disk) tuples."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ValueError
    out = []
    for tenant, limits in value.items():
        if not isinstance(tenant, str) or not tenant or "|" in tenant or any(c.isspace() for c in tenant):
            raise ValueError
        if not isinstance(limits, Mapping) or not limits or set(limits) - {"memory", "disk"}:
            raise ValueError
        memory = parse_size(limits["memory"]) if limits.get("memory") is not None else None
        disk = parse_size(limits["disk"]) if limits.get("disk") is not None else None
        out.append((tenant, memory, disk))
    return tuple(sorted(out))


def host(value: Any) -> str:
    if not isinstance(value, str) or not value or any(c in value for c in "/ "):
        raise ValueError
    return value


def field(default: Any, parse: Callable[[Any], Any], expected: str, doc: str) -> Any:
    return dataclasses.field(default=default, metadata={"parse": parse, "expected": expected, "doc": doc})
