"""The KV cache layout of a running vLLM, read from vLLM itself at ``register_kv_caches``.

vLLM (0.32) hands the connector one tensor per attention layer, of logical
shape ``(blocks, heads, block_tokens, content)``; what sits where inside a
block belongs to the attention backend.  :func:`discover` reads, from vLLM:

- the KV cache spec of the (single) cache group: block size, KV heads, head
  size, dtype; models it cannot serve are refused here (packed or
  quantized-with-scales content); several cache groups go to
  ``_discover_groups``, MLA latent caches to :func:`.mla.discover_mla`;
- each layer's attention module and backend (``static_forward_context``),
  and probes the backend's own cache write, ``impl.do_kv_cache_update``, on a
  scratch block shaped like the real ones (:func:`..blocklayout.probe_block_layout`);
- the layers in model order.

Anything it cannot read with certainty stops vLLM at start with one message
naming the backend, the shape and the reason; never a guess.

Primitives: :class:`EngineLayout`, :func:`discover`, :class:`UnsupportedLayout`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ..blocklayout import LayoutError, probe_block_layout
from ..chunklayout import ChunkLayout, MLAChunkLayout
from ..paged import PagedCopier
from .enginelayout import EngineLayout, UnsupportedLayout, _first_layer, _forward_context, _ordered, _refuse
from .groups import GroupCopier, group_infos
from .mla import discover_mla

__all__ = ["EngineLayout", "UnsupportedLayout", "discover"]

logger = logging.getLogger(__name__)


class _UnitScales:
    """A layer as the backend's cache write sees it, with K/V scales of 1 so the
    probe's values are stored as written (fp8 caches divide by the scales)."""

    def __init__(self, layer: Any, device: Any):
        import torch

        self._layer = layer
        self._k_scale = self._v_scale = torch.tensor(1.0, dtype=torch.float32, device=device)
        self._k_scale_float = self._v_scale_float = 1.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)


def _check_spec(spec: Any, backend: str, shape: Any) -> None:
    kind = type(spec).__name__
    if "MLA" in kind or not hasattr(spec, "num_kv_heads") or not hasattr(spec, "head_size"):
        raise _refuse(
            backend, shape, f"its KV cache spec is {kind}; only standard attention (K and V per head) is supported"
        )
    if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        raise _refuse(backend, shape, "K and V head sizes differ")
    for attr in ("num_head_slots", "state_content_bytes"):
        if getattr(spec, attr, None) is not None:
            raise _refuse(backend, shape, f"the spec packs its pages ({attr}={getattr(spec, attr)})")
    if getattr(spec, "tokens_per_state", 1) != 1:
        raise _refuse(backend, shape, "one stored state does not hold exactly one token")
    quant = getattr(spec, "kv_quant_mode", None)
    mode = str(getattr(quant, "name", quant or "NONE"))
    if mode.upper() != "NONE" and "FP8" not in mode.upper():
        raise _refuse(backend, shape, f"quantized KV ({mode}) is not supported")


def _layer_write(attention: Any, cache: Any) -> Any:
    """``write(key, value, slot_mapping)`` into ``cache`` through the layer's own
    ``do_kv_cache_update``; None when the layer has none."""
    impl = getattr(attention, "impl", None)
    if impl is None or not hasattr(impl, "do_kv_cache_update"):
        return None

    def write(key: Any, value: Any, slots: Any) -> None:
        impl.do_kv_cache_update(attention, key, value, cache, slots)

    return write


def _fp8_dtype(kv_cache_dtype: str) -> Any:
    import torch

    return torch.float8_e5m2 if kv_cache_dtype.endswith("e5m2") else torch.float8_e4m3fn


def discover(
    kv_caches: dict[str, Any], vllm_config: Any, kv_cache_config: Any, chunk: ChunkLayout, *, copy_threads: int = 2
) -> EngineLayout:
    """Read and check the layout of ``kv_caches`` (``register_kv_caches``'s argument)
    against the chunk payload layout the namespace promises; CPU caches are copied
    by ``copy_threads`` threads."""
    import torch

    if not kv_caches:
        raise UnsupportedLayout("lmcache-server connector: vLLM registered no KV cache layers")
    context = _forward_context(vllm_config)
    names, first, attention, impl, backend = _first_layer(kv_caches, context)
    shape = tuple(first.shape)
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if isinstance(chunk, MLAChunkLayout) or any("MLA" in type(g.kv_cache_spec).__name__ for g in groups):
        return discover_mla(kv_caches, vllm_config, kv_cache_config, chunk, copy_threads=copy_threads)
    if len(groups) > 1:  # vLLM's hybrid manager: one copier per group (.groups)
        return _discover_groups(kv_caches, vllm_config, kv_cache_config, chunk, copy_threads=copy_threads)
    spec = groups[0].kv_cache_spec if groups else None
    if spec is not None:
        _check_spec(spec, backend, shape)
    block_size = int(getattr(spec, "block_size", 0) or vllm_config.cache_config.block_size)
    if first.dim() != 4:
        raise _refuse(backend, shape, "expected a 4-D (blocks, heads, block_tokens, content) tensor per layer")
    if len({t.data_ptr() for t in kv_caches.values()}) != len(kv_caches):
        raise _refuse(backend, shape, "layers share KV caches (cross-layer KV sharing)")
    if len(names) != chunk.num_layers:
        raise _refuse(backend, shape, f"{len(names)} KV cache layers, the model config says {chunk.num_layers}")
    _, heads, block_tokens, content = shape
    if (heads, content) != (chunk.num_kv_heads, 2 * chunk.head_dim * chunk.element_bytes // first.element_size()):
        raise _refuse(
            backend, shape, f"expected {chunk.num_kv_heads} KV heads with K and V of {chunk.head_dim} per token"
        )
    if block_size % block_tokens:
        raise _refuse(backend, shape, f"kernel blocks of {block_tokens} do not divide blocks of {block_size}")
    if impl is None or not hasattr(impl, "do_kv_cache_update"):
        raise _refuse(backend, shape, "its attention implementation has no do_kv_cache_update to probe the layout with")

    kv_cache_dtype = str(getattr(impl, "kv_cache_dtype", "auto"))
    fp8 = kv_cache_dtype.startswith("fp8")
    probe_dtype = _fp8_dtype(kv_cache_dtype) if fp8 and first.dtype == torch.uint8 else first.dtype
    if first.element_size() != chunk.element_bytes:
        raise _refuse(
            backend, shape, f"cache elements are {first.element_size()} bytes, the namespace says {chunk.dtype}"
        )
    model_dtype = getattr(vllm_config.model_config, "dtype", first.dtype)
    proxy = _UnitScales(attention, first.device)

    def write(key: Any, value: Any, cache: Any, slots: Any) -> None:
        target = cache.view(first.dtype) if cache.dtype != first.dtype else cache
        impl.do_kv_cache_update(proxy, key, value, target, slots)

    try:
        block = probe_block_layout(
            write,
            block_tokens=block_tokens,
            num_heads=heads,
            head_dim=chunk.head_dim,
            content=content,
            strides=first.stride()[1:],
            dtype=probe_dtype,
            input_dtype=model_dtype if fp8 else first.dtype,
            device=first.device,
        )
    except LayoutError as err:
        raise _refuse(backend, shape, f"probing its cache write: {err}") from err
    except Exception as err:  # the backend's own op refused the scratch block
        raise _refuse(backend, shape, f"its cache write failed on a probe block ({type(err).__name__}: {err})") from err
    layers = [kv_caches[n] for n in names]
    if first.dtype == torch.uint8 and probe_dtype != torch.uint8:
        layers = [t.view(probe_dtype) for t in layers]
    # Loads write through the backend's own op (exact by definition, and faster than
    # strided copies), except for fp8, where it would quantize bytes already quantized.
    writers = None if fp8 else [_layer_write(context.get(n), kv_caches[n]) for n in names]
    if writers is not None and any(w is None for w in writers):
        writers = None
    try:
        copier = PagedCopier(layers, block, writers, threads=copy_threads)
    except LayoutError as err:
        raise _refuse(backend, shape, str(err)) from err
    layout = EngineLayout(backend, block_size, block_tokens, block, copier, names)
    if not block.affine:
        logger.warning("vLLM's %s KV layout is not affine; copies go through a position table (slower)", backend)
    return layout


def _discover_groups(
    kv_caches: dict[str, Any], vllm_config: Any, kv_cache_config: Any, chunk: ChunkLayout, *, copy_threads: int
) -> EngineLayout:
    """Several KV cache groups (full attention and sliding window): each group's layers are
    read and probed like a model of their own; the payload keeps every layer in model order."""
    import types

    names = _ordered(kv_caches)
    if len(names) != chunk.num_layers:
        raise UnsupportedLayout(
            f"lmcache-server connector: {len(names)} KV cache layers, the model config says {chunk.num_layers}"
        )
    row = {name: i for i, name in enumerate(names)}
    copiers: list[GroupCopier] = []
    parts: list[EngineLayout] = []
    for info, group in zip(group_infos(kv_cache_config), kv_cache_config.kv_cache_groups):
        layers = {n: kv_caches[n] for n in group.layer_names}
        single = types.SimpleNamespace(kv_cache_groups=[group])
        part = discover(
            layers, vllm_config, single, dataclasses.replace(chunk, num_layers=len(layers)), copy_threads=copy_threads
        )
        if part.block_size != info.block_size:  # pragma: no cover - vLLM gives every group one block size
            raise UnsupportedLayout(f"lmcache-server connector: group block sizes differ ({info.block_size})")
        parts.append(part)
        copiers.append(GroupCopier(info, [row[n] for n in part.layer_names], part.copier))
    if len({(p.block_size, p.block_tokens) for p in parts}) != 1:
        raise UnsupportedLayout("lmcache-server connector: KV cache groups with different block sizes")
    first = parts[0]
    return EngineLayout(first.backend, first.block_size, first.block_tokens, first.block, first.copier, names, copiers)
