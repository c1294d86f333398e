"""The daemon's settings: :class:`ServerConfig`, one frozen dataclass with a field per key.

Each field gives the key's default, its value parser (from :mod:`.configvalues`),
the text a refusal says was expected, and a line saying what the key does.  The
record also derives what follows from its keys (the effective KV codec, a tier's
tenant quotas).  It is built by :func:`.config.load_config`,
which reads the sources, parses each value and checks the keys against each other
(:func:`.config.check_across_keys`); code imports it from :mod:`.config`.
Primitives: :class:`ServerConfig`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from lmcache_client.protocol import MAX_KEYS_PER_REQUEST

from . import configvalues as v
from .kv_codec import CODEC_MODES, CodecParams, parse_codec, parse_codec_params, resolve_codec


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Every setting of the daemon.  Sizes are bytes; ``None`` means "off"."""

    # -- LMCache-compatible keys -----------------------------------------------------
    chunk_size: int = v.field(
        256,
        v.int_in(1, 1 << 20),
        "an integer number of tokens, 1..1048576",
        "Tokens per chunk; advertised to clients in hello and used for token metrics.",
    )
    local_cpu: bool = v.field(True, v.boolean, "true or false", "Enable the CPU memory tier.")
    max_local_cpu_size: int = v.field(
        5 * 1024**3,
        v.size(1 << 20),
        'a size of at least 1 MiB, e.g. 40 (GB) or "40GiB"',
        "Memory pool size; allocated once at start, never exceeded.",
    )
    local_disk: str | None = v.field(
        None,
        v.optional(v.disk_dir),
        "an absolute directory path or a file:// URL, e.g. /var/cache/lmcache or file:///var/cache/lmcache",
        "Disk spill directory (the disk tier), a path or file:// URL as LMCache takes; unset: no disk tier.",
    )
    max_local_disk_size: int = v.field(
        0, v.size(), 'a size, e.g. 100 (GB) or "100GiB"', "Disk tier bound, in bytes on disk (as du counts them)."
    )
    remote_url: str | None = v.field(
        None,
        v.optional(v.redis_url),
        "a redis://, rediss://, unix:// or redis+cluster:// URL, or mooncake://HOST:PORT",
        "The remote tier shared by every node: a Redis uplink, or a Mooncake Store master (mooncake://, "
        "the mooncake_* keys; docs/storage.md); unset: no remote tier.",
    )
    remote_serde: str = v.field(
        "naive",
        v.choice("naive", "cachegen"),
        "naive or cachegen",
        "What engine-side clients store (LMCache's meaning): cachegen is kv_codec cachegen with its defaults; "
        "naive: raw chunks unless kv_codec says otherwise.",
    )
    kv_codec: str | None = v.field(
        None,
        v.optional(parse_codec),
        f"one of {', '.join(CODEC_MODES)}, optionally with parameters as 'mode:name=value,...'",
        "KV codec the engine adapters encode chunks with (announced in hello; the codec is part of the "
        "namespace); unset: from remote_serde.  See docs/codec.md.",
    )
    kv_codec_params: CodecParams = v.field(
        (),
        parse_codec_params,
        "a map of codec parameter name to value, e.g. {bits: 4}",
        "Parameters of kv_codec (docs/codec.md lists each mode's).",
    )
    save_decode_cache: bool = v.field(
        False, v.boolean, "true or false", "Hint to clients: also store KV produced while decoding."
    )
    # -- the server's own keys -------------------------------------------------------
    remote_key_prefix: str = v.field(
        "lmcache:", v.key_prefix, "a non-empty string without spaces", "Prefix of every key the daemon writes to Redis."
    )
    remote_ttl_s: float = v.field(
        0.0, v.float_in(0.0, 10.0 * 365 * 86400), "seconds, 0 for no expiry", "Expiry of chunks written to Redis."
    )
    remote_timeout_s: float = v.field(
        2.0, v.float_in(0.01, 600.0), "seconds, 0.01..600", "Redis connect and command timeout (bounds each reply)."
    )
    max_remote_queue_size: int = v.field(
        256 * 1024**2,
        v.size(1 << 20),
        'a size of at least 1 MiB, e.g. "256MiB"',
        "Bytes waiting to be written to Redis; beyond it writes are dropped and counted.",
    )
    remote_username: str | None = v.field(None, v.optional(v.string), "a string", "Redis ACL user (or in remote_url).")
    remote_password: str | None = v.field(
        None, v.optional(v.secret), "a string", "Redis password (or in remote_url); prefer LMCACHE_REMOTE_PASSWORD."
    )
    mooncake_metadata_server: str | None = v.field(
        None,
        v.optional(v.mooncake_metadata),
        "http://HOST:PORT/metadata, etcd://HOST:PORT or P2PHANDSHAKE",
        "Mooncake's metadata server; unset: the master's built-in one, http://MASTER_HOST:8080/metadata.",
    )
    mooncake_protocol: str = v.field(
        "tcp", v.choice("tcp", "rdma"), "tcp or rdma", "How Mooncake moves values between nodes."
    )
    mooncake_device_name: str | None = v.field(
        None,
        v.optional(v.string),
        "RDMA device names, comma separated, e.g. mlx5_0,mlx5_1",
        "The RDMA devices Mooncake uses (mooncake_protocol rdma).",
    )
    mooncake_local_hostname: str | None = v.field(
        None,
        v.optional(v.string),
        "a host name or address, optionally with :PORT",
        "Where other nodes reach this node's Mooncake segment; unset: this host's address.",
    )
    mooncake_segment_size: int = v.field(
        1024**3,
        v.size(),
        'a size, e.g. "4GiB"; 0: contribute none',
        "DRAM this node contributes to the Mooncake pool (besides max_local_cpu_size).",
    )
    mooncake_buffer_size: int = v.field(
        256 * 1024**2,
        v.size(16 << 20),
        'a size of at least 16 MiB, e.g. "256MiB"',
        "Mooncake's transfer buffer on this node: holds the values being put and read.",
    )
    mooncake_zero_copy: bool = v.field(
        True,
        v.boolean,
        "true or false",
        "Mooncake puts read chunks straight from the memory pool (false: a copied record each, as for Redis).",
    )
    disk_fsync: str = v.field(
        "none",
        v.choice("none", "data", "full"),
        "none, data or full",
        "Disk writes: none (page cache decides), data (fsync each file), full (file and directory).",
    )
    disk_io_threads: int = v.field(2, v.int_in(1, 64), "an integer 1..64", "Threads doing disk I/O.")
    disk_retry_s: float = v.field(
        30.0,
        v.float_in(0.1, 3600.0),
        "seconds, 0.1..3600",
        "How long a degraded disk tier (full, unwritable) waits before it tries writing again.",
    )
    max_spill_queue_size: int = v.field(
        256 * 1024**2,
        v.size(1 << 20),
        'a size of at least 1 MiB, e.g. "256MiB"',
        "Bytes of evicted chunks waiting to be written to disk; beyond it spills are dropped.",
    )
    disk_direct_io: bool = v.field(
        True,
        v.boolean,
        "true or false",
        "Write chunk files with O_DIRECT (no page-cache copy) where the filesystem supports it.",
    )
    record_tokens: bool = v.field(
        True,
        v.boolean,
        "true or false",
        "With KV events on, write each announced chunk's token ids into its disk file and Redis record "
        "(record format 2), so a disk scan after a crash and a promotion from Redis announce it; false "
        "while daemons that read only format 1 share the Redis tier.",
    )
    spill_ahead_size: int = v.field(
        64 * 1024**2,
        v.size(),
        'a size, e.g. "64MiB" (0: off)',
        "With a disk tier: pool bytes kept free by spilling the coldest chunks early, "
        "written to disk straight from the pool (at most an eighth of the pool).",
    )
    listen: tuple[str, ...] = v.field(
        ("tcp://127.0.0.1:65432",),
        v.listen,
        "a list of tcp://HOST:PORT or ipc:///PATH endpoints",
        "ZeroMQ endpoints the daemon binds (ROUTER).",
    )
    # -- security (docs/security.md) --------------------------------------------------
    auth: str = v.field(
        "none",
        v.choice("none", "curve"),
        "none or curve",
        "none: anyone who reaches an endpoint may do anything; curve: ZeroMQ CURVE keys and tenant grants.",
    )
    server_secret_key_file: str | None = v.field(
        None,
        v.optional(v.string),
        "the path of the daemon's CURVE secret key file (lmcache-server keygen)",
        "The daemon's CURVE key pair (mode 0600); required with auth: curve.",
    )
    client_keys_file: str | None = v.field(
        None,
        v.optional(v.string),
        "the path of the YAML file of client keys and their grants",
        "Client public keys, names, tenant grants and roles; required with auth: curve.",
    )
    query_tokens_file: str | None = v.field(
        None,
        v.optional(v.string),
        "the path of the YAML file of POST /query bearer tokens (mode 0600)",
        "Bearer tokens for POST /query, each admin or limited to tenants (docs/security.md); unset: /query "
        "answers only under auth: none on a loopback metrics_host. Never implied by allow_insecure.",
    )
    allow_insecure: bool = v.field(
        False,
        v.boolean,
        "true or false",
        "Let auth: none bind a non-loopback tcp endpoint (a private network you trust); logged loudly.",
    )
    max_client_inflight_requests: int = v.field(
        256,
        v.int_in(1, 1 << 20),
        "an integer 1..1048576",
        "Requests one client connection may have in flight; beyond it that client gets BUSY.",
    )
    max_client_inflight_bytes: int = v.field(
        512 * 1024**2,
        v.size(1 << 20),
        'a size of at least 1 MiB, e.g. "512MiB"',
        "Payload bytes one client connection may hold in flight (puts and unsent get replies); beyond it BUSY.",
    )
    max_key_inflight_requests: int = v.field(
        0,
        v.int_in(0, 1 << 20),
        "an integer 0..1048576 (0: no limit)",
        "With auth: curve, requests all connections of one client key may have in flight together; "
        "beyond it that key gets BUSY (0: only the per-connection limit).",
    )
    max_key_inflight_bytes: int = v.field(
        0,
        v.size(0),
        'a size, e.g. "2GiB" (0: no limit)',
        "With auth: curve, payload bytes all connections of one client key may hold in flight together; "
        "beyond it BUSY (0: only the per-connection limit).",
    )
    metrics_host: str = v.field("127.0.0.1", v.host, "a host name or IP address", "Address of the HTTP metrics server.")
    metrics_port: int = v.field(
        9464, v.int_in(0, 65535), "a port 1..65535, or 0 to disable", "Port of /metrics and /healthz (0 disables it)."
    )
    sizing_window_chunks: int = v.field(
        1 << 20,
        v.int_in(0, 1 << 40),
        "an integer number of chunk accesses, 0..1099511627776 (0: off)",
        "Sizing telemetry (lmcache_hit_rate_ceiling_ratio beside lmcache_hit_rate_window_ratio): the hit rates "
        "cover the last this many to twice this many chunk accesses, per stream (lookup, get); 0 turns it off.",
    )
    max_message_size: int = v.field(
        512 * 1024**2,
        v.size(4096),
        'a size of at least 4 KiB, e.g. "512MiB"',
        "Largest request accepted (header + payloads); larger gets TOO_LARGE.",
    )
    max_inflight_bytes: int = v.field(
        1024**3,
        v.size(1 << 20),
        'a size of at least 1 MiB, e.g. "1GiB"',
        "Payload bytes being handled or sent at once; above it requests get BUSY.",
    )
    max_keys_per_request: int = v.field(
        4096,
        v.int_in(1, MAX_KEYS_PER_REQUEST),
        f"an integer 1..{MAX_KEYS_PER_REQUEST}",
        "Keys in one request (it also sets the header limit, docs/protocol.md 8.1).",
    )
    max_pinned_fraction: float = v.field(
        0.5,
        v.float_in(0.0, 1.0),
        "a number from 0 to 1",
        "Share of the memory pool that pinned chunks may fill, and of its memory quota a tenant's pins may fill.",
    )
    zmq_hwm: int = v.field(
        256,
        v.int_in(1, 1 << 20),
        "an integer 1..1048576",
        "ZeroMQ send/receive high-water marks, in messages per peer.",
    )
    zmq_io_threads: int = v.field(1, v.int_in(1, 64), "an integer 1..64", "ZeroMQ I/O threads.")
    drain_timeout_s: float = v.field(
        10.0, v.float_in(0.0, 3600.0), "seconds, 0..3600", "On SIGTERM/SIGINT, how long in-flight requests may finish."
    )
    pin_memory: str = v.field(
        "auto",
        v.choice("auto", "on", "off"),
        "auto, on or off",
        "Page-lock the pool for GPU DMA (auto: when CUDA is available).",
    )
    shared_memory: bool = v.field(
        True,
        v.boolean,
        "true or false",
        "Put the pool in a shared-memory segment (in shm_dir) that clients on this host map: "
        "one memcpy per chunk instead of socket transfers.",
    )
    shm_dir: str = v.field(
        "/dev/shm",
        v.abs_path,
        "an absolute directory path on a tmpfs, e.g. /dev/shm",
        "Where the shared pool segment is created (owner-only); too small or missing: frames only.",
    )
    state_dir: str | None = v.field(
        None,
        v.optional(v.abs_path),
        "an absolute directory path of the daemon's user, e.g. /var/lib/lmcache-server",
        "Private directory (created 0700, owner-checked) for what a clean stop keeps for the next start: "
        "the Redis removals owed, the announced chunks' token ids, the installation id of warm restarts; "
        "unset: the local_disk directory, else $XDG_STATE_HOME/lmcache-server (~/.local/state/lmcache-server).",
    )
    shm_access: str = v.field(
        "owner",
        v.choice("owner", "group"),
        "owner or group",
        "Who may map the pool segment: owner (0600, the daemon's user) or group (0660, also its group).",
    )
    shm_lease_timeout_s: float = v.field(
        30.0,
        v.float_in(0.1, 3600.0),
        "seconds, 0.1..3600",
        "How long a shared-memory client may hold a chunk it reads or a slot it writes before it is reclaimed.",
    )
    warm_restart: bool = v.field(
        False,
        v.boolean,
        "true or false",
        "A restart is expected (a supervisor: systemd, compose, Kubernetes; the flag --keep-warm): a clean stop "
        "keeps the shared pool segment and its index, and the next daemon with the same listen addresses and "
        "pool size adopts the memory tier (a crash always starts cold). Off: the segment goes at the stop.",
    )
    warm_restart_max_age_s: float = v.field(
        3600.0,
        v.float_in(0.0, 30 * 86400.0),
        "seconds, 0..2592000",
        "A clean pool segment that a daemon with other listen addresses left in shm_dir longer ago than this "
        "is an orphan (that daemon moved or retired) and is removed at start; younger ones are kept for it.",
    )
    malloc_tuning: bool = v.field(
        True, v.boolean, "true or false", "Keep glibc from mmap/munmap-ing every large receive buffer."
    )
    cache_policy: str = v.field(
        "adaptive",
        v.choice("adaptive", "lfuda", "lru"),
        "adaptive, lfuda or lru",
        "Eviction policy: adaptive (lfuda, refusing first-seen prompts' tails while that pays, LRU order "
        "while an LRU shadow leads), "
        "lfuda (frequency + recency, prefix-aware) or lru; see docs/eviction.md.",
    )
    disk_admission: str = v.field(
        "always",
        v.choice("always", "reused", "frequency"),
        "always, reused or frequency",
        "Which chunks evicted from memory are written to disk: always; reused (read, or put again, since "
        "stored); frequency (a TinyLFU sketch's verdict against the disk's victim); see docs/storage.md.",
    )
    remote_admission: str = v.field(
        "always",
        v.choice("always", "reused", "frequency"),
        "always, reused or frequency",
        "Which chunks stored in memory are written to Redis: always (at once); reused (once read or put "
        "again); frequency (once a TinyLFU sketch counts 2 accesses); see docs/storage.md.",
    )
    tenant_quotas: tuple[tuple[str, int | None, int | None], ...] = v.field(
        (),
        v.tenant_quotas,
        'a map of tenant name to {memory: SIZE, disk: SIZE}, e.g. {acme: {memory: "8GiB", disk: "100GiB"}}',
        "Per-tenant byte caps in the memory and disk tiers; a tenant over its cap evicts its own chunks.",
    )
    # -- KV events for KV-aware routers (docs/events.md) ------------------------------
    events_endpoint: str | None = v.field(
        None,
        v.optional(v.events_endpoint),
        "a tcp://HOST:PORT (HOST may be *) or ipc:///PATH endpoint",
        "Where the daemon publishes KV events in vLLM's format (ZeroMQ PUB); unset: no events.",
    )
    events_replay_endpoint: str | None = v.field(
        None,
        v.optional(v.events_endpoint),
        "a tcp://HOST:PORT (HOST may be *) or ipc:///PATH endpoint",
        "ZeroMQ ROUTER answering replay requests for past event batches (vLLM's protocol); unset: no replay.",
    )
    events_snapshot_endpoint: str | None = v.field(
        None,
        v.optional(v.events_endpoint),
        "a tcp://HOST:PORT (HOST may be *) or ipc:///PATH endpoint",
        "ZeroMQ ROUTER answering snapshot requests: the node's whole announced residency and the "
        "sequence to follow the live stream from (docs/events.md); unset: no snapshots.",
    )
    events_snapshot_timeout_s: float = v.field(
        60.0,
        v.float_in(0.1, 3600.0),
        "seconds, 0.1..3600",
        "The most one snapshot may take, reader included: past it the rest is not sent (no end marker), "
        "the reader is dropped and the next request is answered; the endpoint answers one at a time.",
    )
    events_heartbeat_s: float = v.field(
        1.0,
        v.float_in(0.0, 3600.0),
        "seconds, 0..3600 (0 disables)",
        "An empty event batch on every topic when nothing was published for this long; 0: no heartbeats.",
    )
    events_topic: str = v.field(
        "kv@{node}@{model}",
        v.topic,
        "a string; placeholders {model}, {namespace} and {node} only",
        "Topic of each event batch, per namespace: {model} is its model id, {node} is events_node.",
    )
    events_node: str = v.field(
        "", v.string, "a string (empty: the host name)", "The node name in events_topic (e.g. the pod name for llm-d)."
    )
    events_encoding: str = v.field(
        "map",
        v.choice("map", "array"),
        "map or array",
        "How each event is encoded: map (vLLM 0.32's tagged maps; vLLM's decoder, Dynamo) or array "
        "(the positional arrays of vLLM before 0.32, which llm-d reads); see docs/events.md.",
    )
    events_remote: bool = v.field(
        True,
        v.boolean,
        "true or false",
        "With events and a remote_url: a chunk that leaves memory and disk while this node's Redis uplink "
        "holds it is announced as moved there (medium CPU, locality REMOTE) instead of removed; see docs/events.md.",
    )
    events_remote_max_chunks: int = v.field(
        65536,
        v.int_in(1, 1 << 24),
        "an integer 1..16777216",
        "Keys this node remembers Redis holds (for events_remote); past it the oldest are forgotten "
        "(a chunk announced REMOTE is then announced removed).",
    )
    events_remote_audit_s: float = v.field(
        10.0,
        v.float_in(0.0, 3600.0),
        "seconds, 0..3600 (0 disables)",
        "How often the chunks announced REMOTE are checked in Redis (EXISTS, pipelined) and the gone ones "
        "announced removed; 0: never (only TTLs, reads, deletes and outages are seen).",
    )
    events_block_size: int = v.field(
        16,
        v.int_in(1, 1 << 20),
        "an integer number of tokens that divides chunk_size",
        "Tokens per announced block: set it to the engine's (and router's) block size.",
    )
    events_replay_size: int = v.field(
        64 * 1024**2,
        v.size(1 << 20),
        'a size of at least 1 MiB, e.g. "64MiB"',
        "Bytes of event batches kept for replay (the oldest fall out).",
    )
    events_hwm: int = v.field(
        1000,
        v.int_in(1, 1 << 24),
        "an integer 1..16777216",
        "Batches queued per subscriber; a slower subscriber loses batches (and may replay them).",
    )
    events_batch_max_events: int = v.field(
        256, v.int_in(1, 1 << 20), "an integer 1..1048576", "Events in one batch at most; a full batch is sent at once."
    )
    events_batch_interval_s: float = v.field(
        0.05, v.float_in(0.0, 60.0), "seconds, 0..60", "How long an event waits for others to share its batch."
    )
    log_level: str = v.field(
        "INFO", v.choice("debug", "info", "warning", "error"), "DEBUG, INFO, WARNING or ERROR", "Log verbosity."
    )
    stats_log_interval_s: float = v.field(
        30.0,
        v.float_in(0.0, 86400.0),
        "seconds, 0..86400 (0 disables)",
        "Interval of the one-line INFO summary (hits by tier, tokens reused, throughput); 0 disables it.",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "log_level", self.log_level.upper())

    @functools.cached_property
    def codec(self) -> Any:
        """The effective :class:`~lmcache_client.codec.CodecSpec` clients encode with; ``None``: raw.
        Raises :class:`.kv_codec.CodecSettingError` for a bad setting (the loader checks it first)."""
        return resolve_codec(self.kv_codec, self.kv_codec_params, self.remote_serde)

    def quotas(self, tier: str) -> dict[str, int]:
        """``tenant_quotas`` of one tier ("memory" or "disk"): tenant -> bytes."""
        index = 1 if tier == "memory" else 2
        return {q[0]: q[index] for q in self.tenant_quotas if q[index] is not None}  # type: ignore[misc]
