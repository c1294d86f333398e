"""What the vLLM connector takes from vLLM, with stand-ins when vLLM is absent.

vLLM is imported here and only here.  Without vLLM (CI, unit tests) the
connector module still imports: :class:`KVConnectorBase_V1` and
:class:`KVConnectorMetadata` fall back to minimal local bases carrying the
same metadata-binding methods, so the connector's logic runs against
stand-in config and request objects.

Primitives: ``HAVE_VLLM``, ``KVConnectorBase_V1``, ``KVConnectorMetadata``,
``KVConnectorStats``, ``KVConnectorPromMetrics`` (None without vLLM),
``SupportsHMA`` (vLLM's hybrid-allocator marker), ``KVConnectorTransferResults`` (None
where vLLM has no per-request load failures),
``BASE_TAKES_KV_CACHE_CONFIG``, :func:`tp_rank`, :func:`first_group`,
:func:`resumed`.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

__all__ = [
    "BASE_TAKES_KV_CACHE_CONFIG",
    "HAVE_VLLM",
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorPromMetrics",
    "KVConnectorStats",
    "KVConnectorTransferResults",
    "SupportsHMA",
    "first_group",
    "resumed",
    "tp_rank",
]

try:  # pragma: no cover - exercised only where vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
    )

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Local stand-in for vLLM's (empty) metadata base class."""

    class KVConnectorBase_V1:  # type: ignore[no-redef]  # noqa: N801 - vLLM's name
        """Local stand-in for vLLM's base: the metadata binding the model runner uses."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role
            self._connector_metadata: Any = None

        @property
        def role(self) -> Any:
            return self._role

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None

        def _get_connector_metadata(self) -> Any:
            assert self._connector_metadata is not None
            return self._connector_metadata


try:  # pragma: no cover - exercised only where vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
except ImportError:
    KVConnectorPromMetrics = None

    @dataclasses.dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        """Local stand-in for vLLM's stats base: a dict of observations."""

        data: dict[str, Any] = dataclasses.field(default_factory=dict)

        def to_dict(self) -> dict[str, Any]:
            return self.data


try:  # pragma: no cover - exercised only where vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:

    class SupportsHMA:  # type: ignore[no-redef]
        """Local stand-in for vLLM's marker of connectors that serve several KV cache groups."""


try:  # pragma: no cover - exercised only where vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:
    KVConnectorTransferResults = None


BASE_TAKES_KV_CACHE_CONFIG = "kv_cache_config" in inspect.signature(KVConnectorBase_V1.__init__).parameters
"""Recent vLLM passes ``kv_cache_config`` to connectors; older releases do not."""


def tp_rank() -> int:
    """This worker's tensor-parallel rank (0 without vLLM or before it is set up)."""
    if not HAVE_VLLM:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return int(get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError):  # parallel state not initialised
        return 0


def first_group(block_ids: Any) -> list[int]:
    """Block ids of the first KV cache group: vLLM >= 0.9.2 sends a tuple of lists
    (one per group), older releases a flat list."""
    if not block_ids:
        return []
    first = block_ids[0]
    return list(first) if isinstance(first, list | tuple) else list(block_ids)


def resumed(cached_reqs: Any, index: int, req_id: str) -> bool:
    """Whether a scheduled cached request resumes after preemption (its block list is
    then replaced, not extended).  Recent vLLM has ``resumed_req_ids``; older
    releases a ``resumed_from_preemption`` list."""
    ids = getattr(cached_reqs, "resumed_req_ids", None)
    if ids is not None:
        return req_id in ids
    flags = getattr(cached_reqs, "resumed_from_preemption", None)
    return bool(flags[index]) if flags is not None else False
