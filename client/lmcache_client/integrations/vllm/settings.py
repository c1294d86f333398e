"""The vLLM connector's settings: ``kv_connector_extra_config``, validated once at start.

Every key is optional; an unknown key or a bad value stops vLLM at start with
a message naming it (docs/integrations.md lists them all).

Primitives: :class:`ConnectorSettings`, :data:`ROLES`, :data:`CONSUMER_WAIT_S`,
:data:`ADDRESS_ENV`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ...client import DEFAULT_ADDRESS
from ...connection import ADDRESS_ENV

ROLES = ("kv_both", "kv_producer", "kv_consumer")
CONSUMER_WAIT_S = 5.0
"""How long a ``kv_consumer`` waits for a producer's chunks unless ``load_wait_s`` says."""
# ADDRESS_ENV (connection.py): where the daemon is when ``kv_connector_extra_config``
# does not say (one command line for every replica; compose sets it per service).


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return value.strip().lower() in ("true", "1", "yes", "on")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(value)


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config``, validated once at start."""

    address: str = DEFAULT_ADDRESS
    timeout_s: float = 2.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    chunk_size: int = 256
    model_id: str = ""
    tenant: str = ""
    malloc_tuning: bool = True
    copy_threads: int = 2
    store_tails: bool = False
    load_wait_s: float = -1.0
    """-1: the role's default (:data:`CONSUMER_WAIT_S` for ``kv_consumer``, else 0)."""
    server_public_key: str = ""
    client_secret_key: str = ""
    async_transfers: bool = True
    """Lookups, loads and saves off vLLM's step (:mod:`.worker.transferengine`); false: each one
    runs inside the step, as before 0.9 of this connector (for comparison)."""
    load_deadline_ms: float = 0.0
    """A load uses what arrived within this many milliseconds; the rest is recomputed
    (0: no deadline; asynchronous loads only)."""
    max_queued_saves: int = 256
    """Saves a worker queues at most; more are dropped (counted) while the daemon is slow."""
    prefetch: bool = True
    """Lookups for asynchronous loads ask the daemon to promote the hit chunks it holds
    on disk or in Redis into memory while the request waits for its load."""
    batch_copies: str = "auto"
    """A load's chunks go into the cache as one batch per daemon round trip
    (:mod:`..batched`: on CUDA a side stream and events); ``auto``: on a CUDA cache
    only (on a CPU the chunk-by-chunk copies are faster), ``on`` / ``off``."""
    cost_gate: bool = False
    """Skip loads that the rates seen so far say are slower than computing (:mod:`.scheduler.costgate`)."""
    cost_gate_margin: float = 1.0
    """A load runs while its expected time is at most this many times the compute time."""
    save_decode_cache: bool = False
    """Also store the full chunks of generated tokens (a later turn of the conversation
    reuses them); per request: ``lmcache_save_decode_cache``."""
    max_store_tokens: int = 0
    """The most tokens of a request a ``lmcache_max_store_tokens`` may ask to store (0: no cap)."""
    layerwise_save: bool = False
    """Copy each save's tokens out of the cache layer by layer during the forward pass
    (``save_kv_layer``; :mod:`.layerwise`) instead of all layers after it."""
    layerwise_staging_mb: int = 1024
    """Host staging memory for layer-wise saves (page-locked on CUDA); saves beyond it
    are gathered after the forward pass."""
    codec: str = ""
    """A KV codec spec (``"int8:group=64"``, ``"none"``) instead of the one the daemon
    announces in hello; empty: the daemon's (docs/codec.md)."""

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """Validate ``extra``; ``address`` defaults to ``$LMCACHE_SERVER_ADDRESS``, then
        ``tcp://127.0.0.1:65432``."""
        extra = dict(extra or {})
        if "address" not in extra and os.environ.get(ADDRESS_ENV):
            extra["address"] = os.environ[ADDRESS_ENV]
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(fields))
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(fields)}")
        values: dict[str, Any] = {}
        for name, value in extra.items():
            kind = type(getattr(cls(), name))
            try:
                values[name] = _bool(value) if kind is bool else kind(value)
            except (TypeError, ValueError) as err:
                raise ValueError(f"kv_connector_extra_config {name}={value!r}: expected {kind.__name__}") from err
        settings = cls(**values)
        if min(settings.timeout_s, settings.chunk_size, settings.copy_threads, settings.layerwise_staging_mb) <= 0:
            raise ValueError(
                "kv_connector_extra_config timeout_s, chunk_size, copy_threads and layerwise_staging_mb "
                "must be positive"
            )
        if settings.batch_copies not in ("auto", "on", "off"):
            raise ValueError(f"kv_connector_extra_config batch_copies={settings.batch_copies!r}: auto, on or off")
        if settings.cost_gate_margin <= 0:
            raise ValueError("kv_connector_extra_config cost_gate_margin must be positive")
        if settings.load_deadline_ms < 0 or settings.max_queued_saves <= 0 or settings.max_store_tokens < 0:
            raise ValueError(
                "kv_connector_extra_config needs load_deadline_ms >= 0, max_queued_saves > 0 and max_store_tokens >= 0"
            )
        if "load_wait_s" in extra and settings.load_wait_s < 0:
            raise ValueError("kv_connector_extra_config load_wait_s must be >= 0")
        if not 0 <= settings.backoff_s <= settings.max_backoff_s:
            raise ValueError("kv_connector_extra_config needs 0 <= backoff_s <= max_backoff_s")
        if settings.codec:
            from ...codec.spec import CodecSpec

            try:
                CodecSpec.parse(settings.codec)
            except ValueError as err:
                raise ValueError(f"kv_connector_extra_config codec={settings.codec!r}: {err}") from None
        return settings
