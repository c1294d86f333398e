"""Namespaces: which chunks may be shared.

Two engines share chunks only if they would compute identical KV bytes for the
same tokens: same model, same KV layout, same tensor-parallel shard.  The
namespace string folds all of that together, plus the KV codec chunks are
encoded with (encoded and raw chunks, or two codec settings, never mix), plus
an optional tenant salt so two tenants never see each other's chunks.  The
server treats it as opaque.

Primitives: :class:`Namespace` and its :meth:`Namespace.wire` string;
:func:`chunk_size_of` (the ``c<N>`` field of a namespace string);
:func:`of_model` (the namespaces of one model id: ``admin who-has --model``,
``POST /query``'s ``model`` and ``admin pin --model`` read it alike).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from .protocol.codes import MAX_NAMESPACE_BYTES


@dataclasses.dataclass(frozen=True)
class Namespace:
    """Model id + KV layout + tp rank/size + optional codec and tenant.

    ``wire()`` gives the canonical string, e.g.
    ``meta-llama/Llama-3.1-8B|bfloat16|L32|KV8|D128|tp0of1|c256``, and with a
    codec and a tenant ``...|c256|layout=L2THD|codec=<tag>|tenant=acme`` (the
    tenant stays the last field: the daemon's quotas and grants read it there).
    """

    model: str
    dtype: str
    """KV cache dtype; any spelling (``torch.bfloat16``, ``"bf16"``) is canonicalised."""
    num_layers: int
    num_kv_heads: int
    """KV heads held by this shard (after tensor parallelism), as the engine's cache holds them."""
    head_dim: int
    chunk_size: int
    tp_rank: int = 0
    tp_size: int = 1
    tenant: str = ""
    layout: str = ""
    """Free-form layout tag (e.g. "mla" or an adapter's own tensor layout)."""
    codec: str = ""
    """Tag of the KV codec the chunks are encoded with (``CodecSpec.tag``: mode,
    parameters and format version); empty for raw chunks."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if not self.model or "|" in self.model:
            raise ValueError(f"model must be non-empty and must not contain '|': {self.model!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_size", "tp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} out of range for tp_size {self.tp_size}")
        if "|" in self.tenant or "|" in self.layout:
            raise ValueError("tenant and layout must not contain '|'")
        if "|" in self.codec or any(c.isspace() for c in self.codec):
            raise ValueError(f"codec tag must not contain '|' or whitespace: {self.codec!r}")
        if len(self.wire().encode()) > MAX_NAMESPACE_BYTES:
            raise ValueError(f"namespace longer than {MAX_NAMESPACE_BYTES} bytes")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token on this shard (2 x layers x heads x dim x dtype)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * _dtype_bytes(self.dtype)

    def wire(self) -> str:
        parts = [
            self.model,
            self.dtype,
            f"L{self.num_layers}",
            f"KV{self.num_kv_heads}",
            f"D{self.head_dim}",
            f"tp{self.tp_rank}of{self.tp_size}",
            f"c{self.chunk_size}",
        ]
        if self.layout:
            parts.append(f"layout={self.layout}")
        if self.codec:
            parts.append(f"codec={self.codec}")
        if self.tenant:
            parts.append(f"tenant={self.tenant}")
        return "|".join(parts)

    def __str__(self) -> str:
        return self.wire()


def chunk_size_of(namespace: str) -> int | None:
    """The chunk size a namespace string names in its ``c<N>`` field (as
    :meth:`Namespace.wire` writes it), or None when it names none (a namespace
    of another form).  The first field is the model id, never read as one."""
    for field in namespace.split("|")[1:]:
        if len(field) > 1 and field[0] == "c" and field[1:].isdigit() and field[1:].isascii():
            return int(field[1:])
    return None


def of_model(namespaces: Iterable[str], model: str) -> list[str]:
    """The namespace strings of ``model``: those whose first field (the model id, as
    :meth:`Namespace.wire` writes it) is exactly ``model``, in the order given."""
    return [ns for ns in namespaces if ns.split("|", 1)[0] == model]


_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}
_DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16"}


def canonical_dtype(dtype: object) -> str:
    """``torch.bfloat16``, ``"bf16"``, ``"bfloat16"`` -> ``"bfloat16"``: one spelling per
    dtype, so two engines describing the same KV never land in different namespaces."""
    name = str(dtype).removeprefix("torch.").lower()
    name = _DTYPE_ALIASES.get(name, name)
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_DTYPE_BYTES)}")
    return name


def _dtype_bytes(dtype: str) -> int:
    return _DTYPE_BYTES[canonical_dtype(dtype)]
