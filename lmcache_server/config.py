"""Server configuration: one typed, frozen dataclass, validated once at the edge.

Sources, lowest to highest precedence:

1. built-in defaults (the field defaults below),
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
expected.  Primitives: :class:`ServerConfig`, :func:`load_config`,
:func:`parse_size`.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import re
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from .kv_codec import CODEC_MODES, CodecParams, CodecSettingError, parse_codec, parse_codec_params, resolve_codec

logger = logging.getLogger(__name__)

ENV_PREFIX = "LMCACHE_"
ENV_CONFIG_PATH = "LMCACHE_CONFIG"
ENV_CONFIG_PATHS = (ENV_CONFIG_PATH, "LMCACHE_CONFIG_FILE")
"""Variables naming the config file (ours, then LMCache's); not config keys themselves."""

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """A config value was refused: names the key, the value, its source and what was expected."""

    def __init__(self, key: str, value: Any, expected: str, source: str = ""):
        where = f" (from {source})" if source else ""
        super().__init__(f"config key '{key}'{where}: got {value!r}; expected {expected}")
        self.key = key
        self.value = value
        self.expected = expected


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


def _size(minimum: int = 0) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        size = parse_size(value)
        if size < minimum:
            raise ValueError(f"at least {minimum} bytes")
        return size

    return parse


def _int(lo: int, hi: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ValueError
        return value

    return parse


def _float(lo: float, hi: float) -> Callable[[Any], float]:
    def parse(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
            raise ValueError
        return float(value)

    return parse


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError


def _choice(*options: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if isinstance(value, str) and value.lower() in options:
            return value.lower()
        raise ValueError

    return parse


def _optional(inner: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value in (None, "") else inner(value)


def redact(url: str) -> str:
    """The URL without its password, for logs."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.password is None:
        return url
    return urllib.parse.urlunsplit(parsed._replace(netloc=parsed.netloc.replace(f":{parsed.password}@", ":***@")))


def disk_path(url: str) -> str:
    """The directory of a ``file://`` URL (``file:///var/cache/x`` -> ``/var/cache/x``)."""
    parsed = urllib.parse.urlparse(url)
    return urllib.parse.unquote(parsed.netloc + parsed.path) if parsed.netloc else urllib.parse.unquote(parsed.path)


def _file_url(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError
    parsed = urllib.parse.urlparse(value)
    if parsed.scheme != "file" or not parsed.path:
        raise ValueError
    return value


def _redis_url(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError
    parsed = urllib.parse.urlparse(value)
    if parsed.scheme not in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster"):
        raise ValueError
    if parsed.scheme == "unix" and not parsed.path:
        raise ValueError
    if parsed.scheme != "unix" and not parsed.hostname:
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


def _listen(value: Any) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError
    return tuple(parse_listen_address(str(item).strip()) for item in items)


def _events_endpoint(value: Any) -> str:
    """A ZeroMQ endpoint to bind: ``tcp://HOST:PORT`` (HOST may be ``*``) or ``ipc:///path``."""
    if not isinstance(value, str):
        raise ValueError
    return parse_listen_address(value)


def _topic(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError
    try:
        value.format(model="m", namespace="n", node="h")
    except (KeyError, IndexError, ValueError):
        raise ValueError from None
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError
    return value


def _key_prefix(value: Any) -> str:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise ValueError
    return value


def _abs_path(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise ValueError
    return value


def _tenant_quotas(value: Any) -> tuple[tuple[str, int | None, int | None], ...]:
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


def _host(value: Any) -> str:
    if not isinstance(value, str) or not value or any(c in value for c in "/ "):
        raise ValueError
    return value


def _field(default: Any, parse: Callable[[Any], Any], expected: str, doc: str) -> Any:
    return dataclasses.field(default=default, metadata={"parse": parse, "expected": expected, "doc": doc})


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Every setting of the daemon.  Sizes are bytes; ``None`` means "off"."""

    # -- LMCache-compatible keys -----------------------------------------------------
    chunk_size: int = _field(
        256,
        _int(1, 1 << 20),
        "an integer number of tokens, 1..1048576",
        "Tokens per chunk; advertised to clients in hello and used for token metrics.",
    )
    local_cpu: bool = _field(True, _bool, "true or false", "Enable the CPU memory tier.")
    max_local_cpu_size: int = _field(
        5 * 1024**3,
        _size(1 << 20),
        'a size of at least 1 MiB, e.g. 40 (GB) or "40GiB"',
        "Memory pool size; allocated once at start, never exceeded.",
    )
    local_disk: str | None = _field(
        None,
        _optional(_file_url),
        "a file:// URL such as file:///var/cache/lmcache",
        "Disk spill directory (the disk tier); unset: no disk tier.",
    )
    max_local_disk_size: int = _field(
        0, _size(), 'a size, e.g. 100 (GB) or "100GiB"', "Disk tier bound, in bytes on disk (as du counts them)."
    )
    remote_url: str | None = _field(
        None,
        _optional(_redis_url),
        "a redis://, rediss://, unix:// or redis+cluster:// URL",
        "Redis uplink shared by every node; unset: no Redis tier.",
    )
    remote_serde: str = _field(
        "naive",
        _choice("naive", "cachegen"),
        "naive or cachegen",
        "What engine-side clients store (LMCache's meaning): cachegen is kv_codec cachegen with its defaults; "
        "naive: raw chunks unless kv_codec says otherwise.",
    )
    kv_codec: str | None = _field(
        None,
        _optional(parse_codec),
        f"one of {', '.join(CODEC_MODES)}, optionally with parameters as 'mode:name=value,...'",
        "KV codec the engine adapters encode chunks with (announced in hello; the codec is part of the "
        "namespace); unset: from remote_serde.  See docs/codec.md.",
    )
    kv_codec_params: CodecParams = _field(
        (),
        parse_codec_params,
        "a map of codec parameter name to value, e.g. {bits: 4}",
        "Parameters of kv_codec (docs/codec.md lists each mode's).",
    )
    save_decode_cache: bool = _field(
        False, _bool, "true or false", "Hint to clients: also store KV produced while decoding."
    )
    # -- the server's own keys -------------------------------------------------------
    remote_key_prefix: str = _field(
        "lmcache:", _key_prefix, "a non-empty string without spaces", "Prefix of every key the daemon writes to Redis."
    )
    remote_ttl_s: float = _field(
        0.0, _float(0.0, 10.0 * 365 * 86400), "seconds, 0 for no expiry", "Expiry of chunks written to Redis."
    )
    remote_timeout_s: float = _field(
        2.0, _float(0.01, 600.0), "seconds, 0.01..600", "Redis connect and command timeout (bounds each reply)."
    )
    max_remote_queue_size: int = _field(
        256 * 1024**2,
        _size(1 << 20),
        'a size of at least 1 MiB, e.g. "256MiB"',
        "Bytes waiting to be written to Redis; beyond it writes are dropped and counted.",
    )
    remote_username: str | None = _field(None, _optional(_str), "a string", "Redis ACL user (or in remote_url).")
    remote_password: str | None = _field(
        None, _optional(_str), "a string", "Redis password (or in remote_url); prefer LMCACHE_REMOTE_PASSWORD."
    )
    disk_fsync: str = _field(
        "none",
        _choice("none", "data", "full"),
        "none, data or full",
        "Disk writes: none (page cache decides), data (fsync each file), full (file and directory).",
    )
    disk_io_threads: int = _field(2, _int(1, 64), "an integer 1..64", "Threads doing disk I/O.")
    disk_retry_s: float = _field(
        30.0,
        _float(0.1, 3600.0),
        "seconds, 0.1..3600",
        "How long a degraded disk tier (full, unwritable) waits before it tries writing again.",
    )
    max_spill_queue_size: int = _field(
        256 * 1024**2,
        _size(1 << 20),
        'a size of at least 1 MiB, e.g. "256MiB"',
        "Bytes of evicted chunks waiting to be written to disk; beyond it spills are dropped.",
    )
    disk_direct_io: bool = _field(
        True,
        _bool,
        "true or false",
        "Write chunk files with O_DIRECT (no page-cache copy) where the filesystem supports it.",
    )
    spill_ahead_size: int = _field(
        64 * 1024**2,
        _size(),
        'a size, e.g. "64MiB" (0: off)',
        "With a disk tier: pool bytes kept free by spilling the coldest chunks early, "
        "written to disk straight from the pool (at most an eighth of the pool).",
    )
    listen: tuple[str, ...] = _field(
        ("tcp://127.0.0.1:65432",),
        _listen,
        "a list of tcp://HOST:PORT or ipc:///PATH endpoints",
        "ZeroMQ endpoints the daemon binds (ROUTER).",
    )
    # -- security (docs/security.md) --------------------------------------------------
    auth: str = _field(
        "none",
        _choice("none", "curve"),
        "none or curve",
        "none: anyone who reaches an endpoint may do anything; curve: ZeroMQ CURVE keys and tenant grants.",
    )
    server_secret_key_file: str | None = _field(
        None,
        _optional(_str),
        "the path of the daemon's CURVE secret key file (lmcache-server keygen)",
        "The daemon's CURVE key pair (mode 0600); required with auth: curve.",
    )
    client_keys_file: str | None = _field(
        None,
        _optional(_str),
        "the path of the YAML file of client keys and their grants",
        "Client public keys, names, tenant grants and roles; required with auth: curve.",
    )
    allow_insecure: bool = _field(
        False,
        _bool,
        "true or false",
        "Let auth: none bind a non-loopback tcp endpoint (a private network you trust); logged loudly.",
    )
    max_client_inflight_requests: int = _field(
        256,
        _int(1, 1 << 20),
        "an integer 1..1048576",
        "Requests one client connection may have in flight; beyond it that client gets BUSY.",
    )
    max_client_inflight_bytes: int = _field(
        512 * 1024**2,
        _size(1 << 20),
        'a size of at least 1 MiB, e.g. "512MiB"',
        "Payload bytes one client connection may hold in flight (puts and unsent get replies); beyond it BUSY.",
    )
    max_key_inflight_requests: int = _field(
        0,
        _int(0, 1 << 20),
        "an integer 0..1048576 (0: no limit)",
        "With auth: curve, requests all connections of one client key may have in flight together; "
        "beyond it that key gets BUSY (0: only the per-connection limit).",
    )
    max_key_inflight_bytes: int = _field(
        0,
        _size(0),
        'a size, e.g. "2GiB" (0: no limit)',
        "With auth: curve, payload bytes all connections of one client key may hold in flight together; "
        "beyond it BUSY (0: only the per-connection limit).",
    )
    metrics_host: str = _field("127.0.0.1", _host, "a host name or IP address", "Address of the HTTP metrics server.")
    metrics_port: int = _field(
        9464, _int(0, 65535), "a port 1..65535, or 0 to disable", "Port of /metrics and /healthz (0 disables it)."
    )
    max_message_size: int = _field(
        512 * 1024**2,
        _size(4096),
        'a size of at least 4 KiB, e.g. "512MiB"',
        "Largest request accepted (header + payloads); larger gets TOO_LARGE.",
    )
    max_inflight_bytes: int = _field(
        1024**3,
        _size(1 << 20),
        'a size of at least 1 MiB, e.g. "1GiB"',
        "Payload bytes being handled or sent at once; above it requests get BUSY.",
    )
    max_keys_per_request: int = _field(4096, _int(1, 1 << 20), "an integer 1..1048576", "Keys in one request.")
    max_pinned_fraction: float = _field(
        0.5, _float(0.0, 1.0), "a number from 0 to 1", "Share of the memory pool that pinned chunks may fill."
    )
    zmq_hwm: int = _field(
        256, _int(1, 1 << 20), "an integer 1..1048576", "ZeroMQ send/receive high-water marks, in messages per peer."
    )
    zmq_io_threads: int = _field(1, _int(1, 64), "an integer 1..64", "ZeroMQ I/O threads.")
    drain_timeout_s: float = _field(
        10.0, _float(0.0, 3600.0), "seconds, 0..3600", "On SIGTERM/SIGINT, how long in-flight requests may finish."
    )
    pin_memory: str = _field(
        "auto",
        _choice("auto", "on", "off"),
        "auto, on or off",
        "Page-lock the pool for GPU DMA (auto: when CUDA is available).",
    )
    shared_memory: bool = _field(
        True,
        _bool,
        "true or false",
        "Put the pool in a shared-memory segment (in shm_dir) that clients on this host map: "
        "one memcpy per chunk instead of socket transfers.",
    )
    shm_dir: str = _field(
        "/dev/shm",
        _abs_path,
        "an absolute directory path on a tmpfs, e.g. /dev/shm",
        "Where the shared pool segment is created (owner-only); too small or missing: frames only.",
    )
    shm_access: str = _field(
        "owner",
        _choice("owner", "group"),
        "owner or group",
        "Who may map the pool segment: owner (0600, the daemon's user) or group (0660, also its group).",
    )
    shm_lease_timeout_s: float = _field(
        30.0,
        _float(0.1, 3600.0),
        "seconds, 0.1..3600",
        "How long a shared-memory client may hold a chunk it reads or a slot it writes before it is reclaimed.",
    )
    warm_restart: bool = _field(
        True,
        _bool,
        "true or false",
        "At a clean stop keep the shared pool segment and write its index beside it, so that the next daemon "
        "with the same listen addresses and pool size adopts the memory tier (a crash always starts cold).",
    )
    warm_restart_max_age_s: float = _field(
        3600.0,
        _float(0.0, 30 * 86400.0),
        "seconds, 0..2592000",
        "A clean pool segment that a daemon with other listen addresses left in shm_dir longer ago than this "
        "is an orphan (that daemon moved or retired) and is removed at start; younger ones are kept for it.",
    )
    malloc_tuning: bool = _field(
        True, _bool, "true or false", "Keep glibc from mmap/munmap-ing every large receive buffer."
    )
    cache_policy: str = _field(
        "adaptive",
        _choice("adaptive", "lfuda", "lru"),
        "adaptive, lfuda or lru",
        "Eviction policy: adaptive (lfuda, refusing first-seen prompts' tails while that pays), "
        "lfuda (frequency + recency, prefix-aware) or lru; see docs/eviction.md.",
    )
    tenant_quotas: tuple[tuple[str, int | None, int | None], ...] = _field(
        (),
        _tenant_quotas,
        'a map of tenant name to {memory: SIZE, disk: SIZE}, e.g. {acme: {memory: "8GiB", disk: "100GiB"}}',
        "Per-tenant byte caps in the memory and disk tiers; a tenant over its cap evicts its own chunks.",
    )
    # -- KV events for KV-aware routers (docs/events.md) ------------------------------
    events_endpoint: str | None = _field(
        None,
        _optional(_events_endpoint),
        "a tcp://HOST:PORT (HOST may be *) or ipc:///PATH endpoint",
        "Where the daemon publishes KV events in vLLM's format (ZeroMQ PUB); unset: no events.",
    )
    events_replay_endpoint: str | None = _field(
        None,
        _optional(_events_endpoint),
        "a tcp://HOST:PORT (HOST may be *) or ipc:///PATH endpoint",
        "ZeroMQ ROUTER answering replay requests for past event batches (vLLM's protocol); unset: no replay.",
    )
    events_topic: str = _field(
        "kv@{node}@{model}",
        _topic,
        "a string; placeholders {model}, {namespace} and {node} only",
        "Topic of each event batch, per namespace: {model} is its model id, {node} is events_node.",
    )
    events_node: str = _field(
        "", _str, "a string (empty: the host name)", "The node name in events_topic (e.g. the pod name for llm-d)."
    )
    events_block_size: int = _field(
        16,
        _int(1, 1 << 20),
        "an integer number of tokens that divides chunk_size",
        "Tokens per announced block: set it to the engine's (and router's) block size.",
    )
    events_replay_size: int = _field(
        64 * 1024**2,
        _size(1 << 20),
        'a size of at least 1 MiB, e.g. "64MiB"',
        "Bytes of event batches kept for replay (the oldest fall out).",
    )
    events_hwm: int = _field(
        1000,
        _int(1, 1 << 24),
        "an integer 1..16777216",
        "Batches queued per subscriber; a slower subscriber loses batches (and may replay them).",
    )
    events_batch_max_events: int = _field(
        256, _int(1, 1 << 20), "an integer 1..1048576", "Events in one batch at most; a full batch is sent at once."
    )
    events_batch_interval_s: float = _field(
        0.05, _float(0.0, 60.0), "seconds, 0..60", "How long an event waits for others to share its batch."
    )
    log_level: str = _field(
        "INFO", _choice("debug", "info", "warning", "error"), "DEBUG, INFO, WARNING or ERROR", "Log verbosity."
    )
    stats_log_interval_s: float = _field(
        30.0,
        _float(0.0, 86400.0),
        "seconds, 0..86400 (0 disables)",
        "Interval of the one-line INFO summary (hits by tier, tokens reused, throughput); 0 disables it.",
    )

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
        if self.events_replay_endpoint is not None and self.events_endpoint is None:
            raise ConfigError(
                "events_replay_endpoint", self.events_replay_endpoint, "unset unless events_endpoint is set"
            )
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
            f"metrics={'off' if not self.metrics_port else f'http://{self.metrics_host}:{self.metrics_port}'} "
            f"events={self.events_endpoint or 'off'} "
            f"kv_codec={self.codec.tag if self.codec is not None else 'none'} "
            f"max_message={self.max_message_size >> 20}MiB inflight_budget={self.max_inflight_bytes >> 20}MiB"
        )


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
