"""Server configuration: one typed, frozen record, loaded and validated once at the edge.

The record is :class:`.serverconfig.ServerConfig` (a field per key, importable
from here); this module builds it.  Sources, lowest to highest precedence:

1. built-in defaults (the field defaults of :mod:`.serverconfig`),
2. the YAML file given by ``--config`` (or ``LMCACHE_CONFIG``, or LMCache's
   own name for it, ``LMCACHE_CONFIG_FILE``),
3. environment variables ``LMCACHE_<KEY>`` (e.g. ``LMCACHE_MAX_LOCAL_CPU_SIZE=8GiB``),
4. command-line flags (``--listen``, ``--set key=value``, ...).

Unknown keys in the file and on the command line are an error (naming the
likely key when one is close).  Keys of LMCache's engine side
(:mod:`.lmcacheconfig`: an LMCache config file loads as it is) are one WARNING
naming them, from every source, and are ignored.  Unknown
``LMCACHE_*`` variables are one WARNING listing them, not an error: the
environment is shared (a Kubernetes Service named ``lmcache`` injects
``LMCACHE_PORT=tcp://...`` into every pod; engine-side LMCache variables such
as ``LMCACHE_USE_EXPERIMENTAL`` sit next to ours).  A bad value raises
:class:`ConfigError` naming the key, the value, where it came from and what was
expected (the keys, their defaults and parsers live in :mod:`.serverconfig`,
the value parsers in :mod:`.configvalues`); then the keys are checked against
each other (:func:`check_across_keys`).  Primitives: :func:`load_config`,
:func:`check_across_keys`, :func:`set_overrides`, :func:`summary` (the config's
line in the start's log), :class:`ConfigError`,
:data:`FIELDS`, and (re-exported) :class:`ServerConfig`, :func:`parse_size`.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from lmcache_client.connection import ADDRESS_ENV

from .configvalues import Refused
from .configvalues import disk_path as disk_path  # re-exported: callers import these from here
from .configvalues import is_mooncake as is_mooncake  # re-exported: the daemon picks the remote link with it
from .configvalues import parse_listen_address as parse_listen_address
from .configvalues import parse_size as parse_size
from .configvalues import redact as redact
from .kv_codec import CodecSettingError
from .lmcacheconfig import ENGINE_KEYS, is_engine_key
from .serverconfig import ServerConfig as ServerConfig  # re-exported: code imports the record from here

logger = logging.getLogger(__name__)

ENV_PREFIX = "LMCACHE_"
ENV_CONFIG_PATH = "LMCACHE_CONFIG"
ENV_CONFIG_PATHS = (ENV_CONFIG_PATH, "LMCACHE_CONFIG_FILE")
CLIENT_ENV = (ADDRESS_ENV,)
"""LMCACHE_* variables our clients read (the engines' connector, the admin CLI), exported on
the same hosts as the daemon: neither config keys nor worth a warning."""
"""Variables naming the config file (ours, then LMCache's); not config keys themselves."""


class ConfigError(ValueError):
    """A config value was refused: names the key, the value, its source and what was expected."""

    def __init__(self, key: str, value: Any, expected: str, source: str = ""):
        where = f" (from {source})" if source else ""
        super().__init__(f"config key '{key}'{where}: got {value!r}; expected {expected}")
        self.key = key
        self.value = value
        self.expected = expected


FIELDS = {f.name: f for f in dataclasses.fields(ServerConfig)}


def check_across_keys(config: ServerConfig) -> None:
    """Refuse what no single key's parser can see: keys whose tiers are not built yet,
    settings that contradict each other, the codec setting (:class:`ConfigError`)."""
    c = config
    # Keys whose tiers are not built yet are refused, never silently ignored.
    if c.local_disk is not None and c.max_local_disk_size < 1 << 20:
        raise ConfigError(
            "max_local_disk_size", c.max_local_disk_size, "a size of at least 1 MiB when local_disk is set"
        )
    try:
        _ = c.codec  # resolved (and kept) on first use
    except CodecSettingError as err:
        value = dict(c.kv_codec_params) if err.key == "kv_codec_params" else c.kv_codec
        raise ConfigError(err.key, value, err.expected) from None
    if not c.local_cpu:
        raise ConfigError("local_cpu", False, "true: every chunk passes through the memory tier")
    if c.max_message_size > c.max_inflight_bytes:
        raise ConfigError(
            "max_message_size", c.max_message_size, f"at most max_inflight_bytes ({c.max_inflight_bytes})"
        )
    if c.auth == "curve":
        for key in ("server_secret_key_file", "client_keys_file"):
            if getattr(c, key) is None:
                raise ConfigError(key, None, "a file path when auth is curve (see docs/security.md)")
    else:
        for key in ("max_key_inflight_requests", "max_key_inflight_bytes"):
            if getattr(c, key):
                raise ConfigError(key, getattr(c, key), "0 unless auth is curve (a client key names the client)")
    _check_remote(c)
    if c.chunk_size % c.events_block_size:
        raise ConfigError("events_block_size", c.events_block_size, f"a divisor of chunk_size ({c.chunk_size})")
    for key in ("events_replay_endpoint", "events_snapshot_endpoint"):
        if getattr(c, key) is not None and c.events_endpoint is None:
            raise ConfigError(key, getattr(c, key), "unset unless events_endpoint is set")


_REDIS_ONLY = {
    "remote_ttl_s": "0: Mooncake has no per-object expiry (its master evicts above its watermark)",
    "remote_username": "unset: Mooncake has no authentication (keep it on a private network)",
    "remote_password": "unset: Mooncake has no authentication (keep it on a private network)",
}


def _check_remote(c: ServerConfig) -> None:
    """The remote tier's keys against its kind: the Redis-only ones unset with Mooncake,
    the Mooncake ones only with Mooncake, RDMA with its devices."""
    defaults = {f.name: f.default for f in dataclasses.fields(c)}
    if is_mooncake(c.remote_url):
        for key, expected in _REDIS_ONLY.items():
            if getattr(c, key) != defaults[key]:
                raise ConfigError(key, getattr(c, key), f"{expected}, with remote_url mooncake://")
        if c.mooncake_protocol == "rdma" and not c.mooncake_device_name:
            raise ConfigError("mooncake_device_name", None, "the RDMA device names when mooncake_protocol is rdma")
        return
    for f in dataclasses.fields(c):
        if f.name.startswith("mooncake_") and getattr(c, f.name) != f.default:
            raise ConfigError(f.name, getattr(c, f.name), "unset unless remote_url is mooncake://HOST:PORT")


def _parse_env_value(raw: str) -> Any:
    """Env values are YAML scalars: ``8``, ``true``, ``"8GiB"``, ``tcp://a:1,ipc:///b``."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _read_file(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError("--config", path, f"a readable YAML file ({err.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError("--config", path, f"valid YAML ({err})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("--config", path, "a YAML mapping of key: value")
    return data


def _config_path(environ: Mapping[str, str]) -> str | None:
    """The file named by LMCACHE_CONFIG / LMCACHE_CONFIG_FILE (refused if they disagree)."""
    named = {name: environ[name] for name in ENV_CONFIG_PATHS if environ.get(name)}
    if len(set(named.values())) > 1:
        raise ConfigError(
            ENV_CONFIG_PATHS[1], named[ENV_CONFIG_PATHS[1]], f"the same file as {ENV_CONFIG_PATH} (or only one of them)"
        )
    return next(iter(named.values()), None)


def _warn_unknown_env(unknown: list[str]) -> None:
    """One WARNING for every LMCACHE_* variable that is no config key (with a likely key, if any)."""
    if not unknown:
        return
    described = []
    for name in sorted(unknown):
        close = difflib.get_close_matches(name[len(ENV_PREFIX) :].lower(), FIELDS, n=1)
        described.append(f"{name} (did you mean {ENV_PREFIX}{close[0].upper()}: {close[0]}?)" if close else name)
    logger.warning("ignoring %d LMCACHE_* environment variable(s) that are no config key: %s",
                   len(described), ", ".join(described))  # fmt: skip


def _warn_engine_keys(ignored: list[tuple[str, str]]) -> None:
    """One WARNING naming the LMCache engine-side keys given (key, source), which are ignored."""
    if ignored:
        described = ", ".join(f"{key} ({source})" for key, source in ignored)
        logger.warning("ignoring %d LMCache engine-side key(s), which configure LMCache inside the engines, "
                       "not this daemon (docs/configuration.md, LMCache compatibility): %s",
                       len(ignored), described)  # fmt: skip


def _unknown_key(key: str, value: Any, source: str) -> ConfigError:
    """The refusal of a key no source may give: the likely key when one is close, never the whole list."""
    close = difflib.get_close_matches(key, [*FIELDS, *ENGINE_KEYS], n=1)
    if not close:
        hint = "every key is in docs/configuration.md and in the output of lmcache-server --print-config"
    elif close[0] in FIELDS:
        hint = f"did you mean '{close[0]}'?"
    else:
        hint = f"did you mean '{close[0]}'? (an LMCache engine-side key, which this daemon ignores)"
    return ConfigError(key, value, f"a known key; {hint}", source)


def set_overrides(items: Sequence[str]) -> dict[str, Any]:
    """The config keys given on a command line as ``--set KEY=VALUE`` (VALUE read as YAML)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError("--set", item, "KEY=VALUE")
        out[key.strip()] = yaml.safe_load(value) if value else None
    return out


def load_config(
    path: str | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ServerConfig:
    """Merge defaults, file, ``LMCACHE_*`` env and overrides; parse each value, build
    the record and check its keys against each other; return it.

    Unknown keys in the file or ``overrides`` raise :class:`ConfigError`;
    LMCache's engine-side keys (any source) and unknown ``LMCACHE_*`` variables
    are ignored, each group named in one WARNING.
    """
    environ = os.environ if environ is None else environ
    path = path or _config_path(environ)
    raw: dict[str, tuple[Any, str]] = {}
    if path:
        for key, value in _read_file(path).items():
            raw[str(key)] = (value, f"file {path}")
    unknown_env: list[str] = []
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name in ENV_CONFIG_PATHS or name in CLIENT_ENV:
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key in FIELDS or is_engine_key(key, FIELDS):
            raw[key] = (_parse_env_value(value), f"env {name}")
        else:
            unknown_env.append(name)
    for key, value in (overrides or {}).items():
        raw[key] = (value, "command line")
    _mooncake_extra_config(raw)

    values: dict[str, Any] = {}
    engine_keys: list[tuple[str, str]] = []
    for key, (value, source) in raw.items():
        spec = FIELDS.get(key)
        if spec is None:
            if not is_engine_key(key, FIELDS):
                raise _unknown_key(key, value, source)
            engine_keys.append((key, source))
            continue
        try:
            values[key] = spec.metadata["parse"](value)
        except Refused as err:
            raise ConfigError(key, value, err.expected, source) from None
        except (ValueError, TypeError):
            raise ConfigError(key, value, spec.metadata["expected"], source) from None
    config = ServerConfig(**values)
    check_across_keys(config)
    _warn_engine_keys(engine_keys)
    _warn_unknown_env(unknown_env)
    return config


LMCACHE_MOONCAKE_KEYS = {
    "metadata_server": "mooncake_metadata_server",
    "protocol": "mooncake_protocol",
    "device_name": "mooncake_device_name",
    "local_hostname": "mooncake_local_hostname",
    "global_segment_size": "mooncake_segment_size",
    "local_buffer_size": "mooncake_buffer_size",
}
"""LMCache's Mooncake settings (in its ``extra_config``) and the keys that mean the same here."""


def _mooncake_extra_config(raw: dict[str, tuple[Any, str]]) -> None:
    """An LMCache config with ``remote_url: mooncakestore://`` carries its Mooncake settings
    in ``extra_config``: read them as the ``mooncake_*`` keys (a key set directly wins).
    LMCache's sizes are bytes (a bare number here is GB)."""
    url, extra = raw.get("remote_url"), raw.get("extra_config")
    if url is None or extra is None or not isinstance(extra[0], Mapping) or not is_mooncake(str(url[0])):
        return
    for theirs, ours in LMCACHE_MOONCAKE_KEYS.items():
        value = extra[0].get(theirs)
        if value is None or ours in raw:
            continue
        if ours in ("mooncake_segment_size", "mooncake_buffer_size") and isinstance(value, int):
            value = f"{value}B"
        if ours == "mooncake_device_name" and value == "":
            continue
        raw[ours] = (value, f"{extra[1]} (extra_config.{theirs})")


def summary(c: ServerConfig) -> str:
    """One log line with the effective settings of ``c``."""
    gib = 1024**3
    admission = (
        ""
        if c.disk_admission == c.remote_admission == "always"
        else f"admission=disk:{c.disk_admission},redis:{c.remote_admission} "
    )
    return (
        f"listen={','.join(c.listen)} auth={c.auth}{' (allow_insecure)' if c.allow_insecure else ''} "
        f"memory={c.max_local_cpu_size / gib:.2f}GiB "
        f"policy={c.cache_policy} chunk_size={c.chunk_size} "
        f"disk={c.local_disk or 'off'}"
        f"{f' ({c.max_local_disk_size / gib:.2f}GiB)' if c.local_disk else ''} "
        f"remote={redact(c.remote_url) if c.remote_url else 'off'} "
        f"{admission}"
        f"metrics={'off' if not c.metrics_port else f'http://{c.metrics_host}:{c.metrics_port}'} "
        f"events={c.events_endpoint or 'off'} "
        f"kv_codec={c.codec.tag if c.codec is not None else 'none'} "
        f"max_message={c.max_message_size >> 20}MiB inflight_budget={c.max_inflight_bytes >> 20}MiB"
    )
