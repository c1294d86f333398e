"""Hugging Face transformers adapter: prefill only the part of a prompt the daemon lacks.

``CachedPrefill(model, client, model_id=...)`` wraps a causal LM (Llama,
Mistral, Qwen2 and other models whose attention uses a plain full-attention
KV cache).  For a prompt it:

1. derives the prompt's chunk keys (:func:`~lmcache_client.keys.chunk_keys`);
2. asks the daemon how many leading chunks it holds, never counting the
   chunk that holds the last token (at least one token is computed, so the
   model returns logits for the next token);
3. fetches those chunks and loads their K/V into a ``DynamicCache`` (the
   ``past_key_values`` / ``cache`` object of the installed transformers);
4. runs the model over the remaining tokens only;
5. stores every full chunk it computed (:meth:`CachedPrefill.save`; on by
   default, separate so a caller can return the first token before storing).

Payloads use the shared layout of :mod:`.chunklayout`: GQA caches keep their
``num_key_value_heads``; MLA models (DeepSeek V2/V3) store their cached
latent (:mod:`.hf_mla`), the same chunks as vLLM's connector; fp32, fp16 and
bf16 models work (the namespace holds the dtype).  Batch size is 1.  ``model_id`` must name the *weights*: two
models stored under one id would read each other's KV.  Chunks are encoded
with the KV codec the daemon announces in ``hello`` (``kv_codec``; none by
default), under that codec's namespace: no code changes for the user.

Primitives: :class:`CachedPrefill` (``prefill``, ``save``, ``generate``),
:class:`PrefillResult`, :class:`GenerateResult`, :class:`Timings`.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Sequence
from typing import Any

from ..client import CacheClient
from ..keys import chunk_keys, chunk_tokens
from ..tensors import tensor_bytes
from .chunklayout import ChunkLayout, MLAChunkLayout
from .hf_mla import mla_cache_from, mla_layout, mla_stage
from .transfer import DEFAULT_MAX_BATCH_BYTES, ChunkTransfer


def _torch() -> Any:
    import torch

    return torch


@dataclasses.dataclass
class Timings:
    """Seconds spent in each phase of one prefill."""

    lookup_s: float = 0.0
    load_s: float = 0.0
    """Fetching the cached chunks and building the KV cache from them."""
    compute_s: float = 0.0
    """The model's forward pass over the tokens that were not reused."""
    save_s: float = 0.0

    @property
    def first_token_s(self) -> float:
        """Time until the next-token logits exist (lookup + load + compute)."""
        return self.lookup_s + self.load_s + self.compute_s


@dataclasses.dataclass
class PrefillResult:
    tokens: list[int]
    keys: list[bytes]
    """Chunk keys of every full chunk of ``tokens``."""
    logits: Any
    """``(1, n, vocab)``: the last position only, or every computed one with ``all_logits``."""
    cache: Any
    """The model's KV cache, holding all of ``tokens``; pass it on to decode."""
    reused_tokens: int
    computed_tokens: int
    saved_chunks: int = 0
    """Chunks stored by :meth:`CachedPrefill.save` (stored now or already there)."""
    timings: Timings = dataclasses.field(default_factory=Timings)


@dataclasses.dataclass
class GenerateResult:
    tokens: list[int]
    """The generated token ids (not including the prompt)."""
    prefill: PrefillResult


def _token_list(input_ids: Any) -> list[int]:
    if hasattr(input_ids, "tolist"):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(f"batch size must be 1, got input_ids of shape {tuple(input_ids.shape)}")
            input_ids = input_ids[0]
        return [int(t) for t in input_ids.tolist()]
    return [int(t) for t in input_ids]


class CachedPrefill:
    """Prefix reuse through one daemon for one HF causal LM (batch size 1).

    ``client`` may be shared with other uses: every call passes this adapter's
    namespace explicitly.  Failures of the daemon are misses (the model computes
    everything), never errors.
    """

    def __init__(
        self,
        model: Any,
        client: CacheClient,
        *,
        model_id: str | None = None,
        chunk_size: int = 256,
        tenant: str = "",
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    ):
        config = model.config.get_text_config()
        model_id = model_id or config.name_or_path
        if not model_id:
            raise ValueError("the model has no name_or_path (built from a config?): pass model_id=")
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.model = model
        self.config = config
        # MLA models (DeepSeek V2/V3) cache a latent per token: the chunks vLLM's connector stores
        mla = mla_layout(config, chunk_size, str(model.dtype))
        self.layout = mla or ChunkLayout(config.num_hidden_layers, kv_heads, head_dim, chunk_size, str(model.dtype))
        self.namespace = self.layout.namespace(model_id, tenant=tenant)
        # codec_layout: chunks are encoded with the codec the daemon announces (docs/codec.md)
        self.transfer = ChunkTransfer(
            client, self.namespace, self.layout.nbytes, max_batch_bytes=max_batch_bytes, codec_layout=self.layout
        )
        # transformers 5 renamed the forward argument `past_key_values` to `cache`
        # (the old name still works there, with a deprecation warning).
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @property
    def chunk_size(self) -> int:
        return self.layout.chunk_size

    # -- prefill ---------------------------------------------------------------------
    def prefill(self, input_ids: Any, *, save: bool = True, all_logits: bool = False) -> PrefillResult:
        """Run the prompt through the model, reusing the daemon's leading chunks.

        ``all_logits``: return logits for every computed position instead of the
        last one only.  ``save``: store the new full chunks before returning.
        """
        torch = _torch()
        tokens = _token_list(input_ids)
        if not tokens:
            raise ValueError("empty prompt")
        timings = Timings()
        started = time.perf_counter()
        keys = chunk_keys(tokens, self.chunk_size)
        # Never the whole prompt: the chunk holding the last token is recomputed.
        reusable = min(len(keys), (len(tokens) - 1) // self.chunk_size)
        hits = self.transfer.lookup(keys[:reusable]) if reusable else 0
        looked_up = time.perf_counter()
        timings.lookup_s = looked_up - started
        with torch.inference_mode():
            staging = self._load(keys[:hits])
            cache = self._cache_from(staging)
            loaded = time.perf_counter()
            timings.load_s = loaded - looked_up
            reused = len(staging) * self.chunk_size
            ids = torch.tensor([tokens[reused:]], dtype=torch.long, device=self.model.device)
            out = self.model(
                input_ids=ids, use_cache=True, logits_to_keep=0 if all_logits else 1, **{self.cache_kwarg: cache}
            )
        timings.compute_s = time.perf_counter() - loaded
        result = PrefillResult(tokens, keys, out.logits, cache, reused, len(tokens) - reused, timings=timings)
        if save:
            self.save(result)
        return result

    def _load(self, keys: Sequence[bytes]) -> Any:
        """The leading stored chunks of ``keys``, ``(n, *layout.shape)`` on the host
        (copied straight from the daemon's pool when it shares it)."""
        torch = _torch()
        staging = torch.empty((len(keys), *self.layout.shape), dtype=self.model.dtype)
        if not keys:
            return staging
        return staging[: self.transfer.get_prefix_into(keys, [staging[i] for i in range(len(keys))])]

    def _cache_from(self, staging: Any) -> Any:
        """A DynamicCache holding the K/V of ``staging`` (consecutive chunks from token 0)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        n = len(staging)
        if not n:
            return cache
        layers, _, chunk, heads, dim = self.layout.shape
        staging = staging.to(self.model.device)
        if isinstance(self.layout, MLAChunkLayout):
            return mla_cache_from(staging, self.layout, self.config)
        for layer in range(layers):
            # (chunks, tokens, heads, dim) -> (1, heads, chunks * tokens, dim)
            k, v = (staging[:, layer, kv].permute(2, 0, 1, 3).reshape(1, heads, n * chunk, dim) for kv in (0, 1))
            cache.update(k, v, layer)
        return cache

    # -- save ------------------------------------------------------------------------
    def save(self, result: PrefillResult) -> int:
        """Store the full chunks ``result`` computed (those after its reused prefix)."""
        torch = _torch()
        started = time.perf_counter()
        first = result.reused_tokens // self.chunk_size
        last = len(result.keys)
        if last <= first:
            return 0
        layers, _, chunk, heads, dim = self.layout.shape
        m = last - first
        staging = torch.empty((m, *self.layout.shape), dtype=self.model.dtype)
        start, end = first * chunk, last * chunk
        if isinstance(self.layout, MLAChunkLayout):
            mla_stage(result.cache, self.layout, self.config, staging, start)
        else:
            for layer, (k, v) in enumerate(_layer_kv(result.cache, layers)):
                for kv, states in enumerate((k, v)):
                    # (1, heads, tokens, dim) -> (chunks, tokens per chunk, heads, dim)
                    part = states[0, :, start:end].reshape(heads, m, chunk, dim).permute(1, 2, 0, 3)
                    staging[:, layer, kv].copy_(part)
        result.saved_chunks = self.transfer.put(
            result.keys[first:last],
            [tensor_bytes(staging[i]) for i in range(m)],
            chunk_tokens(result.tokens, self.chunk_size)[first:last],  # for KV events (docs/events.md)
        )
        result.timings.save_s = time.perf_counter() - started
        return result.saved_chunks

    # -- generate --------------------------------------------------------------------
    def generate(
        self, input_ids: Any, max_new_tokens: int, *, eos_token_id: int | None = None, save: bool = True
    ) -> GenerateResult:
        """Greedy decoding after a cached prefill; stops after ``eos_token_id``."""
        if max_new_tokens <= 0:
            raise ValueError("max_new_tokens must be positive")
        torch = _torch()
        result = self.prefill(input_ids, save=save)
        next_id = int(result.logits[0, -1].argmax())
        new = [next_id]
        with torch.inference_mode():
            while len(new) < max_new_tokens and next_id != eos_token_id:
                ids = torch.tensor([[next_id]], dtype=torch.long, device=self.model.device)
                out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self.cache_kwarg: result.cache})
                next_id = int(out.logits[0, -1].argmax())
                new.append(next_id)
        return GenerateResult(new, result)


def _layer_kv(cache: Any, num_layers: int) -> list[tuple[Any, Any]]:
    """(keys, values) of each layer, ``(1, kv_heads, tokens, head_dim)`` each."""
    layers = cache.layers
    if len(layers) != num_layers:
        raise ValueError(f"the cache has {len(layers)} layers, the model config {num_layers}")
    return [(layer.keys, layer.values) for layer in layers]
