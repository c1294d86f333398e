"""Recurrent state of vLLM's Mamba / GDN layers, keyed by the exact prefix length it belongs to.

A Mamba or gated-delta-net layer keeps no per-token K/V: it keeps one state
(a short convolution window and an SSM matrix) that folds in every token so
far.  A state computed after ``n`` tokens is right for a prefix of exactly
``n`` tokens and wrong for every other length, so it is stored under a key
that names the prefix *and* its length, in a namespace of its own.

What vLLM 0.32 defines (``mamba_cache_mode: "align"``, the default with
prefix caching for hybrid models; read from ``v1/core/sched/scheduler.py``,
``v1/core/single_type_kv_cache_manager.py`` ``MambaManager`` and
``v1/kv_cache_interface.py`` ``MambaSpec``):

- Each Mamba layer is in a KV cache group of its own kind (``MambaSpec``);
  every group shares one block size, which vLLM raises for full-attention
  groups until a page of K/V is as large as a page of state (1152 tokens for
  the tiny Qwen3-Next of tests/integrations/vllm).
- Slot ``p`` of a Mamba group's block table holds the state after exactly
  ``(p + 1) * block_size`` tokens.  The scheduler ends prefill chunks on block
  boundaries so that the state at a chunk's end is such a state; it is
  written by the step that ends there.  Earlier slots are nulled (freed) a
  step later, so a saver copies a state out in the step that wrote it.
- A prefix hit is a whole number of blocks; a hit of ``k`` blocks needs the
  single state in slot ``k - 1`` (the other slots of the hit are the null block).
- A layer's cache, as the worker sees it, is one tensor per state part
  (``MambaSpec.shapes`` / ``dtypes``, e.g. GDN: conv ``(3, conv_dim)`` and SSM
  ``(heads, k_dim, v_dim)``), each viewed as ``(num_blocks, *shape)`` over a
  shared padded page (``page_size_padded``), so only ``state_content_size``
  bytes of a page are state.

Key: ``SHA-256(b"lmcache-state-v1" || prev || u32le(n) || u32le(r) || u32le(tokens[n-r:n]))``
where ``prev`` is the chunk-key chain (:mod:`lmcache_client.keys`) of the
prefix's full chunks and ``r = n mod chunk_size`` (the tokens after them).
It names the exact ``n`` tokens, so no state is ever read at another length,
and lives in its own domain, so it never equals a chunk or a tail key.

Payload: for each Mamba group in vLLM's group order, for each layer of the
group in its order, for each state part: the part's bytes of that block,
C-contiguous (:attr:`StateLayout.state_bytes` in all).  The namespace's
``layout`` field carries a tag of the Mamba kind and every part's shape and
dtype (:meth:`StateLayout.namespace`), so states of another geometry never mix
with these nor with full-attention chunks.

The connector's use of it (what is saved, looked up and loaded) is in
:mod:`.states` and :mod:`.scheduler.statescheduling`; docs/integrations.md "Mamba / GDN hybrids".

Primitives: :func:`state_key`, :func:`state_key_after`, :func:`state_slot`,
:func:`state_after_step`, :class:`StateLayout` (:meth:`~StateLayout.from_kv_cache_config`,
:meth:`~StateLayout.namespace`, :meth:`~StateLayout.bind`), :class:`BoundState`
(``gather`` / ``scatter``) and :class:`UnsupportedState`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
from collections.abc import Sequence
from typing import Any

from ...keys import ROOT_KEY, chunk_keys, pack_tokens
from ...namespace import Namespace, canonical_dtype
from ...protocol.codes import KEY_BYTES

STATE_DOMAIN = b"lmcache-state-v1"
NULL_BLOCK_ID = 0  # vllm.v1.attention.backends.utils.NULL_BLOCK_ID


class UnsupportedState(ValueError):
    """vLLM's Mamba state is in a form this module does not store."""


def state_key_after(prev: bytes, rest: Sequence[int], num_tokens: int) -> bytes:
    """The state key of a prefix of ``num_tokens`` tokens: ``prev`` is the chain key of
    its full chunks (ROOT_KEY or a salted root when it has none), ``rest`` the tokens
    after them (``num_tokens mod chunk_size`` of them)."""
    if len(prev) != KEY_BYTES:
        raise ValueError(f"previous key must be {KEY_BYTES} bytes, got {len(prev)}")
    if num_tokens <= 0 or len(rest) > num_tokens:
        raise ValueError(f"a state follows at least one token and {len(rest)} trailing tokens, got {num_tokens}")
    head = struct.pack("<II", num_tokens, len(rest))
    return hashlib.sha256(STATE_DOMAIN + prev + head + pack_tokens(rest)).digest()


def state_key(tokens: Sequence[int], num_tokens: int, chunk_size: int, root: bytes = ROOT_KEY) -> bytes:
    """The key of the state after exactly the first ``num_tokens`` of ``tokens``."""
    if not 0 < num_tokens <= len(tokens):
        raise ValueError(f"num_tokens must be in 1..{len(tokens)}, got {num_tokens}")
    full = num_tokens // chunk_size * chunk_size if chunk_size > 0 else 0
    keys = chunk_keys(tokens[:full], chunk_size, root)
    return state_key_after(keys[-1] if keys else root, tokens[full:num_tokens], num_tokens)


def state_slot(num_tokens: int, block_size: int) -> int:
    """The block-table slot of a Mamba group that holds the state after ``num_tokens``
    tokens in align mode; only whole blocks have one."""
    if num_tokens <= 0 or num_tokens % block_size:
        raise ValueError(f"align mode keeps states after whole blocks of {block_size} tokens, not after {num_tokens}")
    return num_tokens // block_size - 1


def state_after_step(num_computed: int, num_scheduled: int, block_size: int) -> int | None:
    """The prefix length whose state a step leaves in the block table (a step that
    computes ``num_scheduled`` tokens after ``num_computed``), or None when the step
    ends inside a block (vLLM keeps no reusable state there)."""
    end = num_computed + num_scheduled
    return end if num_scheduled > 0 and end % block_size == 0 else None


def _dtype_bytes(dtype: Any) -> int:
    import torch

    return int(torch.empty((), dtype=dtype).element_size())


@dataclasses.dataclass(frozen=True)
class StateGroup:
    """One Mamba KV cache group: its layers and the parts of each layer's state."""

    group_id: int
    layer_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]

    @property
    def layer_bytes(self) -> int:
        return sum(math.prod(s) * _dtype_bytes(d) for s, d in zip(self.shapes, self.dtypes, strict=True))


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """The Mamba groups of a vLLM engine and how one state's payload is laid out."""

    groups: tuple[StateGroup, ...]
    block_size: int
    mamba_type: str
    tp_replicated: bool = False

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: Any) -> StateLayout | None:
        """Read vLLM's ``KVCacheConfig``; None when the model has no Mamba group.

        Refuses (:class:`UnsupportedState`) what a state saved here could not serve:
        a mode other than align (prefix caching off keeps no reusable state),
        speculative or prefill-checkpoint blocks, groups of unequal block sizes."""
        from vllm.v1.kv_cache_interface import MambaSpec

        groups: list[StateGroup] = []
        kinds: set[str] = set()
        sizes: set[int] = set()
        replicated: set[bool] = set()
        for gid, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            if not isinstance(spec, MambaSpec):
                continue
            where = f"KV cache group {gid} ({', '.join(group.layer_names[:3])})"
            if spec.mamba_cache_mode != "align":
                raise UnsupportedState(
                    f"{where}: mamba_cache_mode is {spec.mamba_cache_mode!r}; only 'align' keeps "
                    "states at block boundaries (enable prefix caching)"
                )
            if spec.num_speculative_blocks or spec.num_prefill_checkpoint_blocks:
                raise UnsupportedState(f"{where}: speculative or prefill-checkpoint state blocks are not stored")
            groups.append(StateGroup(gid, tuple(group.layer_names), tuple(map(tuple, spec.shapes)), tuple(spec.dtypes)))
            kinds.add(str(getattr(spec.mamba_type, "name", spec.mamba_type)).lower())
            sizes.add(spec.block_size)
            replicated.add(bool(spec.tp_replicated))
        if not groups:
            return None
        if len(sizes) != 1 or len(replicated) != 1:
            raise UnsupportedState(f"Mamba groups differ in block size {sorted(sizes)} or TP replication")
        return cls(tuple(groups), sizes.pop(), "+".join(sorted(kinds)), replicated.pop())

    @property
    def layer_names(self) -> list[str]:
        return [name for g in self.groups for name in g.layer_names]

    @property
    def state_bytes(self) -> int:
        """Bytes of one stored state (every Mamba layer, padding excluded)."""
        return sum(g.layer_bytes * len(g.layer_names) for g in self.groups)

    def tag(self) -> str:
        """The namespace layout tag: the kind, the layer count and each part's shape and dtype."""
        parts: list[str] = []
        for g in self.groups:
            geometry = ",".join(
                f"{'x'.join(map(str, s))}:{canonical_dtype(d)}" for s, d in zip(g.shapes, g.dtypes, strict=True)
            )
            if not parts or parts[-1] != geometry:
                parts.append(geometry)
        return f"state-{self.mamba_type}-L{len(self.layer_names)}-" + ";".join(parts)

    def namespace(self, kv: Namespace) -> Namespace:
        """The states' namespace next to the full-attention chunks' ``kv`` namespace:
        the same model, dtype, chunk size and tenant, this layout's tag, and one
        namespace for every TP rank when each rank holds the whole state."""
        tag = self.tag() if not kv.layout else f"{kv.layout}+{self.tag()}"
        if self.tp_replicated:
            return dataclasses.replace(kv, layout=tag, tp_rank=0, tp_size=1)
        return dataclasses.replace(kv, layout=tag)

    def bind(self, kv_caches: dict[str, Any]) -> BoundState:
        """The worker's per-layer caches (``register_kv_caches``), checked against the spec."""
        tensors: list[list[Any]] = []
        for g in self.groups:
            for name in g.layer_names:
                if name not in kv_caches:
                    raise UnsupportedState(f"Mamba layer {name} has no KV cache")
                parts = kv_caches[name]
                if not isinstance(parts, (list, tuple)) or len(parts) != len(g.shapes):
                    raise UnsupportedState(f"Mamba layer {name}: expected {len(g.shapes)} state tensors")
                for part, shape, dtype in zip(parts, g.shapes, g.dtypes, strict=True):
                    if tuple(part.shape[1:]) != shape or part.dtype != dtype:
                        raise UnsupportedState(
                            f"Mamba layer {name}: state tensor {tuple(part.shape)} {part.dtype}, "
                            f"the spec says (blocks, {', '.join(map(str, shape))}) {dtype}"
                        )
                tensors.append(list(parts))
        return BoundState(self, tensors)


class BoundState:
    """One worker's Mamba caches: copy a state out of a block and back into another."""

    def __init__(self, layout: StateLayout, tensors: list[list[Any]]):
        self.layout = layout
        self._tensors = tensors  # per layer (groups in order), per state part

    def _blocks(self, block_ids: Sequence[int]) -> list[int]:
        groups = self.layout.groups
        if len(block_ids) != len(groups):
            raise ValueError(f"one block id per Mamba group ({len(groups)}), got {len(block_ids)}")
        out: list[int] = []
        for g, block in zip(groups, block_ids, strict=True):
            if block == NULL_BLOCK_ID:
                raise ValueError(f"group {g.group_id}: block {block} is vLLM's null block, it holds no state")
            out += [block] * len(g.layer_names)
        return out

    def gather(self, block_ids: Sequence[int]) -> bytearray:
        """The payload of the state in ``block_ids`` (one block per Mamba group)."""
        import torch

        out = bytearray(self.layout.state_bytes)
        flat = torch.frombuffer(out, dtype=torch.uint8)
        at = 0
        for parts, block in zip(self._tensors, self._blocks(block_ids), strict=True):
            for part in parts:
                src = part[block].contiguous().reshape(-1).view(torch.uint8)
                flat[at : at + src.numel()].copy_(src.cpu())
                at += src.numel()
        return out

    def scatter(self, block_ids: Sequence[int], payload: Any) -> None:
        """Write a payload from :meth:`gather` (any buffer) into ``block_ids``."""
        import torch

        view = memoryview(payload).cast("B")
        if view.nbytes != self.layout.state_bytes:
            raise ValueError(f"a state is {self.layout.state_bytes} bytes, got {view.nbytes}")
        flat = torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)
        at = 0
        for parts, block in zip(self._tensors, self._blocks(block_ids), strict=True):
            for part in parts:
                dst = part[block]
                n = dst.numel() * dst.element_size()
                dst.copy_(flat[at : at + n].view(part.dtype).reshape(dst.shape).to(part.device))
                at += n
