"""Per-request control of the vLLM connector: ``kv_transfer_params``, read and validated.

A client sets them per request (OpenAI server: ``"kv_transfer_params": {...}``
in the request body; offline: ``SamplingParams(extra_args={"kv_transfer_params":
{...}})``).  Every name starts with ``lmcache_``; other names belong to other
connectors and are left alone.  A value of the wrong type or range is logged
and ignored: the request runs as if it had not been set, never fails.  The
operator's settings cap what a request may ask.

- ``lmcache_skip_load`` (bool): nothing is loaded for this request (it is computed);
- ``lmcache_skip_save`` (bool): nothing of this request is stored;
- ``lmcache_max_store_tokens`` (int >= 0): store only the chunks within its first
  N tokens (capped by the ``max_store_tokens`` setting);
- ``lmcache_load_deadline_ms`` (number > 0): the deadline of its load
  (asynchronous loads; never later than the ``load_deadline_ms`` setting when
  that is set);
- ``lmcache_tags`` (str or list of str): folded into the key chain like
  ``cache_salt``: only requests with the same tags share chunks;
- ``lmcache_save_decode_cache`` (bool): also store the full chunks of generated
  tokens (default: the ``save_decode_cache`` setting);
- ``lmcache_load_wait_s`` (number >= 0): a consumer's wait for a producer
  (capped by ``load_wait_s``; docs/integrations.md).
- ``lmcache_ttl_s`` (number > 0) and ``lmcache_retention`` (a non-empty
  string): refused.  The daemon keeps no per-chunk TTL or retention class, so
  it cannot promise to drop (or keep) the request's chunks on time; a request
  that asks is not stored at all (its load still runs) and a warning says
  why.  A bad value is ignored like any other.

One name goes the other way: ``lmcache_prompt_sources`` is what the connector
returns with a finished request's outputs (the OpenAI server's response carries
it as ``kv_transfer_params``): its prompt tokens by source
(scheduler/sources.py).  A proxy that forwards a response's params into the
next request's is not warned about it; it is ignored on the way in.

Primitives: :class:`RequestParams`, :func:`request_params`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

logger = logging.getLogger(__name__)

PREFIX = "lmcache_"
KNOWN = (
    "lmcache_skip_load",
    "lmcache_skip_save",
    "lmcache_max_store_tokens",
    "lmcache_load_deadline_ms",
    "lmcache_tags",
    "lmcache_save_decode_cache",
    "lmcache_load_wait_s",
    "lmcache_ttl_s",
    "lmcache_retention",
    "lmcache_prompt_sources",
)
PROMPT_SOURCES = "lmcache_prompt_sources"
"""Returned with a request's outputs, not read: its prompt tokens by source."""
REFUSED = ("lmcache_ttl_s", "lmcache_retention")
"""Known, validated, and not acted on: the daemon has no per-chunk TTL or retention
class.  A request with a valid one is not stored (never kept longer than asked)."""


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """What one request asked for, after validation and the operator's caps."""

    skip_load: bool = False
    skip_save: bool = False
    max_store_tokens: int | None = None
    """None: no limit beyond the prompt (and decode tokens with ``save_decode_cache``)."""
    load_deadline_s: float | None = None
    """None: the ``load_deadline_ms`` setting."""
    tags: tuple[str, ...] = ()
    save_decode_cache: bool | None = None
    """None: the ``save_decode_cache`` setting."""


DEFAULT = RequestParams()


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError("expected true or false")


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError("expected a whole number >= 0")
    return value


def _millis(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) or value <= 0:
        raise ValueError("expected a number > 0")
    return float(value)


def _tags(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(t, str) and t for t in items) or len(items) > 16:
        raise ValueError("expected a non-empty string or a list of at most 16 of them")
    return tuple(sorted(set(items)))


def _retention(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("expected a non-empty string")
    return value


def request_params(request: Any, *, max_store_tokens: int = 0, load_deadline_ms: float = 0.0) -> RequestParams:
    """The request's ``lmcache_*`` parameters, validated; a bad value is logged and ignored.
    ``max_store_tokens`` / ``load_deadline_ms``: the operator's caps (0: none)."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict) or not any(isinstance(k, str) and k.startswith(PREFIX) for k in params):
        return DEFAULT
    values: dict[str, Any] = {}
    readers = {
        "lmcache_skip_load": ("skip_load", _flag),
        "lmcache_skip_save": ("skip_save", _flag),
        "lmcache_max_store_tokens": ("max_store_tokens", _count),
        "lmcache_load_deadline_ms": ("load_deadline_s", _millis),
        "lmcache_tags": ("tags", _tags),
        "lmcache_save_decode_cache": ("save_decode_cache", _flag),
        "lmcache_ttl_s": ("skip_save", _millis),
        "lmcache_retention": ("skip_save", _retention),
    }
    req_id = getattr(request, "request_id", "?")
    refused = False
    for name, value in params.items():
        if not isinstance(name, str) or not name.startswith(PREFIX):
            continue
        if name not in KNOWN:
            logger.warning("request %s: ignoring unknown kv_transfer_params %s (known: %s)", req_id, name, KNOWN)
            continue
        if name not in readers:
            # lmcache_load_wait_s: read where the wait is decided (scheduler/matcher.py);
            # lmcache_prompt_sources: the connector's output, nothing to read.
            continue
        field, read = readers[name]
        try:
            read_value = read(value)
        except ValueError as err:
            logger.warning("request %s: ignoring kv_transfer_params %s=%r: %s", req_id, name, value, err)
            continue
        if name not in REFUSED:
            values[field] = read_value
        else:
            refused = True
            logger.warning(
                "request %s: kv_transfer_params %s=%r refused: lmcache-server keeps no per-chunk TTL or "
                "retention class; nothing of this request is stored (its load still runs)",
                req_id,
                name,
                value,
            )
    if refused:  # never kept longer than asked: not kept at all
        values["skip_save"] = True
    if "max_store_tokens" in values and max_store_tokens > 0:
        values["max_store_tokens"] = min(values["max_store_tokens"], max_store_tokens)
    if "load_deadline_s" in values:
        asked = values["load_deadline_s"]
        values["load_deadline_s"] = (min(asked, load_deadline_ms) if load_deadline_ms > 0 else asked) / 1000
    return RequestParams(**values)
