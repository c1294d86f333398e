"""LMCache compatibility of the config: what this daemon does with an LMCache engine config.

A user moving from LMCache points the daemon at the YAML file their engines
already read (``LMCACHE_CONFIG_FILE``).  Its keys fall in three groups:

* shared keys (``chunk_size``, ``local_cpu``, ``max_local_cpu_size``,
  ``local_disk``, ``max_local_disk_size``, ``remote_url``, ``remote_serde``,
  ``save_decode_cache``, ``cache_policy``): fields of
  :class:`.serverconfig.ServerConfig` with LMCache's meaning, parsed there;
* engine-side keys (:data:`ENGINE_KEYS`: blending, layerwise, P2P, PD/NIXL,
  controller, plugins, ...): they configure LMCache inside the engine, which
  this daemon is not; the loader names them in one WARNING and ignores them;
* ``remote_url`` schemes of LMCache's own connectors (:func:`remote_url_advice`):
  refused with what to use instead, since the daemon's shared tier speaks Redis.

The key names were taken from LMCache's documented configuration (its
``lmcache/v1/config.py`` key table, the deprecated aliases it still reads, and
the keys of earlier v1 releases).  Primitives: :data:`ENGINE_KEYS`,
:func:`is_engine_key`, :func:`remote_url_advice`.
"""

from __future__ import annotations

from collections.abc import Collection

ENGINE_KEYS = frozenset(
    {
        # memory and disk details of the engine's own LMCache backends
        "local_cpu_use_hugepages", "reserve_local_cpu_size", "local_disk_path_sharding",
        "enable_lazy_memory_allocator", "lazy_memory_initial_ratio", "lazy_memory_expand_trigger_ratio",
        "lazy_memory_step_ratio", "lazy_memory_safe_size", "numa_mode", "pin_timeout_sec",
        "pin_check_interval_sec", "cost_aware_half_life_seconds", "cost_aware_ewma_alpha",
        # what the engine stores and retrieves
        "use_layerwise", "save_unfull_chunk", "pre_caching_hash_algorithm", "enable_async_loading",
        "retrieve_locations", "store_location", "min_retrieve_tokens", "hit_miss_ratio",
        "blocking_timeout_secs", "lookup_timeout_ms", "priority_limit", "py_enable_gc",
        "use_gpu_connector_v3", "enable_kv_events", "enable_scheduler_bypass_lookup",
        "external_lookup_client", "lookup_server_worker_ids", "extra_config", "error_handling",
        # CacheBlend
        "enable_blending", "blend_recompute_ratio", "blend_recompute_ratios", "blend_thresholds",
        "blend_check_layers", "blend_min_tokens", "blend_special_str",
        # P2P sharing and the controller
        "enable_p2p", "p2p_host", "p2p_init_ports", "p2p_lookup_ports", "lookup_url", "distributed_url",
        "enable_controller", "lmcache_instance_id", "controller_url", "controller_pull_url",
        "controller_reply_url", "lmcache_worker_port", "lmcache_worker_ports", "lmcache_worker_ids",
        "lmcache_worker_heartbeat_delay_time", "lmcache_worker_heartbeat_time", "transfer_channel",
        # PD disaggregation (NIXL), current names and deprecated ones
        "enable_pd", "enable_xpyd", "pd_role", "pd_buffer_size", "pd_buffer_device", "pd_peer_host",
        "pd_peer_init_port", "pd_peer_alloc_port", "pd_peer_query_port", "pd_proxy_host", "pd_proxy_port",
        "pd_allocation_timeout_sec", "pd_shutdown_timeout_sec", "pd_condition_poll_interval_sec",
        "pd_max_prefill_len", "pd_backend_mode", "pd_skip_proxy_notification", "pd_bidirectional",
        "enable_nixl", "nixl_role", "nixl_backends", "nixl_buffer_size", "nixl_buffer_device",
        "nixl_peer_host", "nixl_peer_port", "nixl_peer_init_port", "nixl_peer_alloc_port",
        "nixl_proxy_host", "nixl_proxy_port", "nixl_receiver_host", "nixl_receiver_port", "nixl_enable_gc",
        # other backends of the engine (GDS, Weka, Maru) and plugins
        "gds_path", "gds_path_sharding", "gds_buffer_size", "use_gds", "gds_backend", "cufile_buffer_size",
        "weka_path", "maru_path", "maru_pool_size", "audit_actual_remote_url",
        "runtime_plugin_locations", "plugin_locations", "storage_plugins", "external_backends",
        "remote_storage_plugins", "script_allowed_imports",
        # the engine's internal API server, the multi-process server SGLang starts, remote config
        "internal_api_server_enabled", "internal_api_server_host", "internal_api_server_port_start",
        "internal_api_server_include_index_list", "internal_api_server_socket_path_prefix",
        "mp_host", "mp_port", "remote_config_url", "app_id",
        # statistics and hidden-state caching inside the engine
        "enable_chunk_statistics", "chunk_statistics_auto_start_statistics",
        "chunk_statistics_auto_exit_timeout_hours", "chunk_statistics_auto_exit_target_unique_chunks",
        "chunk_statistics_strategy", "enable_hidden_state_cache", "max_hidden_state_cpu_size",
        "hidden_state_layers", "hidden_states_retrieve_mode",
        # the encoder cache's overrides: a nested ``ec:`` map (``ec_<key>`` is handled below)
        "ec",
    }
)  # fmt: skip
"""LMCache keys that configure LMCache inside the engine: ignored here, with one warning."""

_EC_PREFIX = "ec_"  # LMCache reads ``ec_<key>`` as an encoder-cache override of ``<key>``


def is_engine_key(key: str, shared: Collection[str]) -> bool:
    """Whether ``key`` is an LMCache engine-side key (``shared``: the daemon's own keys,
    so an ``ec_`` override of a shared key such as ``ec_chunk_size`` counts too)."""
    if key in ENGINE_KEYS:
        return True
    rest = key[len(_EC_PREFIX) :] if key.startswith(_EC_PREFIX) else ""
    return bool(rest) and (rest in ENGINE_KEYS or rest in shared)


_TO_REDIS = "redis://HOST:PORT, rediss:// (TLS) or redis+cluster://HOST:PORT"
_SERVE_ENGINES = "or leave remote_url unset and point the engines at this daemon (docs/integrations.md)"

# LMCache's remote connectors, by URL scheme, and what to use with this daemon instead.
_LMCACHE_SCHEMES = {
    "lm": "LMCache's own cache server; this daemon replaces it: leave remote_url unset and point the engines "
    f"at this daemon (docs/integrations.md); for a tier shared by several daemons use {_TO_REDIS}",
    "redis-sentinel": f"Redis Sentinel is not supported: name the primary with {_TO_REDIS}, {_SERVE_ENGINES}",
    "valkey": f"Valkey speaks the Redis protocol: write it as {_TO_REDIS}",
    "fs": "a shared-filesystem connector: for a local disk tier set local_disk to the directory; for a tier "
    f"shared by several daemons use {_TO_REDIS}",
}
_OTHER_SCHEME = f"an LMCache engine-side connector this daemon does not serve: use {_TO_REDIS}, {_SERVE_ENGINES}"
KNOWN_LMCACHE_SCHEMES = frozenset(
    {
        "lm", "redis-sentinel", "valkey", "fs", "infinistore", "blackhole", "audit", "s3",
        "mock", "external", "sagemaker-hyperpod", "gcs", "azure", "hf3fs", "eic", "bigtable", "couchbase",
        "shmfile", "benchmark", "nixl",
    }
)  # fmt: skip
"""``remote_url`` schemes of LMCache's connectors (refused with :func:`remote_url_advice`)."""


def remote_url_advice(scheme: str) -> str | None:
    """What to use instead of an LMCache ``remote_url`` of this scheme; ``None``: not LMCache's."""
    scheme = scheme.lower()
    if scheme not in KNOWN_LMCACHE_SCHEMES:
        return None
    return f"not {scheme}:// ({_LMCACHE_SCHEMES.get(scheme, _OTHER_SCHEME)})"
