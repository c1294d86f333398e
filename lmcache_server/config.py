"""Server configuration: one typed, frozen dataclass, validated once at the edge.

Sources, lowest to highest precedence:

1. built-in defaults (the field defaults of :mod:`.configfields`),
2. the YAML file given by ``--config`` (or ``LMCACHE_CONFIG``, or LMCache's
   own name for it, ``LMCACHE_CONFIG_FILE``),
3. environment variables ``LMCACHE_<KEY>`` (e.g. ``LMCACHE_MAX_LOCAL_CPU_SIZE=8GiB``),
4. command-line flags (``--listen``, ``--set key=value``, ...).

Unknown keys in the file and on the command line are an error.  Unknown
``LMCACHE_*`` variables are one WARNING listing them, not an error: the
environment is shared (a Kubernetes Service named ``lmcache`` injects
``LMCACHE_PORT=tcp://...`` into every pod; engine-side LMCache variables such
as ``LMCACHE_USE_EXPERIMENTAL`` sit next to ours).  A bad value raises
:class:`ConfigError` naming the key, the value, where it came from and what was
expected (the keys, their defaults and parsers live in :mod:`.configfields`,
the value parsers in :mod:`.configvalues`).  Primitives: :class:`ServerConfig`,
:func:`load_config`, :func:`parse_size`.
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

from .configfields import ConfigFields
from .configvalues import disk_path as disk_path  # re-exported: callers import these from here
from .configvalues import parse_listen_address as parse_listen_address
from .configvalues import parse_size as parse_size
from .configvalues import redact as redact
from .kv_codec import CodecSettingError, resolve_codec

logger = logging.getLogger(__name__)

ENV_PREFIX = "LMCACHE_"
ENV_CONFIG_PATH = "LMCACHE_CONFIG"
ENV_CONFIG_PATHS = (ENV_CONFIG_PATH, "LMCACHE_CONFIG_FILE")
"""Variables naming the config file (ours, then LMCache's); not config keys themselves."""


class ConfigError(ValueError):
    """A config value was refused: names the key, the value, its source and what was expected."""

    def __init__(self, key: str, value: Any, expected: str, source: str = ""):
        where = f" (from {source})" if source else ""
        super().__init__(f"config key '{key}'{where}: got {value!r}; expected {expected}")
        self.key = key
        self.value = value
        self.expected = expected


@dataclasses.dataclass(frozen=True)
class ServerConfig(ConfigFields):
    """Every setting of the daemon (the keys: :class:`.configfields.ConfigFields`), checked across keys."""

    def __post_init__(self) -> None:
        # Keys whose tiers are not built yet are refused, never silently ignored.
        if self.local_disk is not None and self.max_local_disk_size < 1 << 20:
            raise ConfigError(
                "max_local_disk_size", self.max_local_disk_size, "a size of at least 1 MiB when local_disk is set"
            )
        try:
            codec = resolve_codec(self.kv_codec, self.kv_codec_params, self.remote_serde)
        except CodecSettingError as err:
            value = dict(self.kv_codec_params) if err.key == "kv_codec_params" else self.kv_codec
            raise ConfigError(err.key, value, err.expected) from None
        object.__setattr__(self, "_codec", codec)
        if not self.local_cpu:
            raise ConfigError("local_cpu", False, "true: every chunk passes through the memory tier")
        if self.max_message_size > self.max_inflight_bytes:
            raise ConfigError(
                "max_message_size", self.max_message_size, f"at most max_inflight_bytes ({self.max_inflight_bytes})"
            )
        if self.auth == "curve":
            for key in ("server_secret_key_file", "client_keys_file"):
                if getattr(self, key) is None:
                    raise ConfigError(key, None, "a file path when auth is curve (see docs/security.md)")
        else:
            for key in ("max_key_inflight_requests", "max_key_inflight_bytes"):
                if getattr(self, key):
                    raise ConfigError(key, getattr(self, key), "0 unless auth is curve (a client key names the client)")
        if self.chunk_size % self.events_block_size:
            raise ConfigError(
                "events_block_size", self.events_block_size, f"a divisor of chunk_size ({self.chunk_size})"
            )
        for key in ("events_replay_endpoint", "events_snapshot_endpoint"):
            if getattr(self, key) is not None and self.events_endpoint is None:
                raise ConfigError(key, getattr(self, key), "unset unless events_endpoint is set")
        object.__setattr__(self, "log_level", self.log_level.upper())

    @property
    def codec(self) -> Any:
        """The effective :class:`~lmcache_client.codec.CodecSpec` clients encode with; ``None``: raw."""
        return self.__dict__["_codec"]

    def quotas(self, tier: str) -> dict[str, int]:
        """``tenant_quotas`` of one tier ("memory" or "disk"): tenant -> bytes."""
        index = 1 if tier == "memory" else 2
        return {q[0]: q[index] for q in self.tenant_quotas if q[index] is not None}  # type: ignore[misc]

    def summary(self) -> str:
        """One log line with the effective settings."""
        gib = 1024**3
        return (
            f"listen={','.join(self.listen)} auth={self.auth}{' (allow_insecure)' if self.allow_insecure else ''} "
            f"memory={self.max_local_cpu_size / gib:.2f}GiB "
            f"policy={self.cache_policy} chunk_size={self.chunk_size} "
            f"disk={self.local_disk or 'off'}"
            f"{f' ({self.max_local_disk_size / gib:.2f}GiB)' if self.local_disk else ''} "
            f"remote={redact(self.remote_url) if self.remote_url else 'off'} "
            f"{self._admission_summary()}"
            f"metrics={'off' if not self.metrics_port else f'http://{self.metrics_host}:{self.metrics_port}'} "
            f"events={self.events_endpoint or 'off'} "
            f"kv_codec={self.codec.tag if self.codec is not None else 'none'} "
            f"max_message={self.max_message_size >> 20}MiB inflight_budget={self.max_inflight_bytes >> 20}MiB"
        )

    def _admission_summary(self) -> str:
        if self.disk_admission == self.remote_admission == "always":
            return ""
        return f"admission=disk:{self.disk_admission},redis:{self.remote_admission} "


FIELDS = {f.name: f for f in dataclasses.fields(ServerConfig)}


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
    """Merge defaults, file, ``LMCACHE_*`` env and overrides; validate; return the config.

    Unknown keys in the file or ``overrides`` raise :class:`ConfigError`;
    unknown ``LMCACHE_*`` variables are logged once (WARNING) and ignored.
    """
    environ = os.environ if environ is None else environ
    path = path or _config_path(environ)
    raw: dict[str, tuple[Any, str]] = {}
    if path:
        for key, value in _read_file(path).items():
            raw[str(key)] = (value, f"file {path}")
    unknown_env: list[str] = []
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name in ENV_CONFIG_PATHS:
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key not in FIELDS:
            unknown_env.append(name)
            continue
        raw[key] = (_parse_env_value(value), f"env {name}")
    for key, value in (overrides or {}).items():
        raw[key] = (value, "command line")

    values: dict[str, Any] = {}
    for key, (value, source) in raw.items():
        spec = FIELDS.get(key)
        if spec is None:
            raise ConfigError(key, value, f"a known key ({', '.join(sorted(FIELDS))})", source)
        try:
            values[key] = spec.metadata["parse"](value)
        except (ValueError, TypeError):
            raise ConfigError(key, value, spec.metadata["expected"], source) from None
    config = ServerConfig(**values)
    _warn_unknown_env(unknown_env)
    return config
