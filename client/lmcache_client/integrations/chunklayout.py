"""The chunk payload layout shared by the HF and vLLM adapters.

A chunk payload holds the K and V of ``chunk_size`` consecutive tokens for
every layer of one tensor-parallel shard, as one contiguous tensor of shape
``(num_layers, 2, chunk_size, num_kv_heads, head_dim)`` (2 = K, V) in the KV
cache dtype, native byte order.  Token-major rows match vLLM's NHD paged
blocks; the HF adapter transposes its ``(batch, heads, tokens, dim)`` cache.
The namespace's layout field carries :data:`CHUNK_LAYOUT`, so engines that
agree on model, dtype and shard may share chunks, and anything stored in
another layout is never read as this one.

MLA models (DeepSeek V2/V3, Kimi K2) cache one latent per token and layer
instead: :class:`MLAChunkLayout`, tagged :data:`MLA_CHUNK_LAYOUT`, stored
once for all tensor-parallel ranks.

Primitives: :class:`ChunkLayout` (shape and byte size of a payload, and its
:class:`~lmcache_client.namespace.Namespace`), :data:`CHUNK_LAYOUT`,
:class:`MLAChunkLayout`, :data:`MLA_CHUNK_LAYOUT`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

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

    planes: ClassVar[int] = 2
    """Planes per layer (K and V); :class:`MLAChunkLayout` has one."""
    tag: ClassVar[str] = CHUNK_LAYOUT

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.planes, self.chunk_size, self.num_kv_heads, self.head_dim)

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
            layout=self.tag,
            codec=codec,
        )


MLA_CHUNK_LAYOUT = "L1TC"
"""Layout tag of MLA latent payloads ``(layers, 1, tokens, kv_lora_rank + rope_dim)``."""


@dataclasses.dataclass(frozen=True)
class MLAChunkLayout(ChunkLayout):
    """An MLA model's chunk payload: per layer and token the latent ``kv_c_normed || k_pe``
    (``head_dim`` = ``kv_lora_rank + qk_rope_head_dim``, 576 for DeepSeek V2/V3), one
    plane and one "head": ``shape`` is ``(layers, 1, tokens, 1, latent)``, byte for byte
    the ``(layers, 1, tokens, latent)`` of the :data:`MLA_CHUNK_LAYOUT` tag.  The latent
    is the same on every tensor-parallel rank, so :meth:`namespace` ignores the rank:
    one copy per node (docs/integrations.md, MLA)."""

    planes: ClassVar[int] = 1
    tag: ClassVar[str] = MLA_CHUNK_LAYOUT

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_kv_heads != 1:
            raise ValueError(f"an MLA latent has one head, got num_kv_heads={self.num_kv_heads}")

    @classmethod
    def of(cls, num_layers: int, latent_dim: int, chunk_size: int, dtype: str) -> MLAChunkLayout:
        """The layout of ``num_layers`` layers of ``latent_dim``-wide latents."""
        return cls(num_layers=num_layers, num_kv_heads=1, head_dim=latent_dim, chunk_size=chunk_size, dtype=dtype)

    def namespace(
        self, model: str, *, tp_rank: int = 0, tp_size: int = 1, tenant: str = "", codec: str = ""
    ) -> Namespace:
        """Every rank's namespace is the same (``tp0of1``): ``tp_rank``/``tp_size`` are ignored."""
        return super().namespace(model, tenant=tenant, codec=codec)
