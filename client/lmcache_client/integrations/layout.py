"""The chunk payload layout shared by the HF and vLLM adapters.

A chunk payload holds the K and V of ``chunk_size`` consecutive tokens for
every layer of one tensor-parallel shard, as one contiguous tensor of shape
``(num_layers, 2, chunk_size, num_kv_heads, head_dim)`` (2 = K, V) in the KV
cache dtype, native byte order.  Token-major rows match vLLM's NHD paged
blocks; the HF adapter transposes its ``(batch, heads, tokens, dim)`` cache.
The namespace's layout field carries :data:`CHUNK_LAYOUT`, so engines that
agree on model, dtype and shard may share chunks, and anything stored in
another layout is never read as this one.

Primitives: :class:`ChunkLayout` (shape and byte size of a payload, and its
:class:`~lmcache_client.namespace.Namespace`) and :data:`CHUNK_LAYOUT`.
"""

from __future__ import annotations

import dataclasses

from ..namespace import Namespace, canonical_dtype

CHUNK_LAYOUT = "L2THD"
"""Layout tag of ``(layers, K/V, tokens, kv heads, head dim)`` payloads."""

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """Shape of one chunk payload; ``dtype`` is any spelling ``canonical_dtype`` knows."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    chunk_size: int
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.chunk_size, self.num_kv_heads, self.head_dim)

    @property
    def element_bytes(self) -> int:
        return _DTYPE_BYTES.get(self.dtype, 1)

    @property
    def nbytes(self) -> int:
        """Bytes of one chunk payload."""
        layers, kv, tokens, heads, dim = self.shape
        return layers * kv * tokens * heads * dim * self.element_bytes

    def namespace(
        self, model: str, *, tp_rank: int = 0, tp_size: int = 1, tenant: str = "", codec: str = ""
    ) -> Namespace:
        """The namespace under which chunks of this layout are stored (``codec``: the
        tag of the codec they are encoded with, empty for raw payloads)."""
        return Namespace(
            model=model,
            dtype=self.dtype,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            chunk_size=self.chunk_size,
            tp_rank=tp_rank,
            tp_size=tp_size,
            tenant=tenant,
            layout=CHUNK_LAYOUT,
            codec=codec,
        )
