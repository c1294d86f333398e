"""Several KV cache groups: sliding-window models under vLLM's hybrid KV cache manager.

With ``SupportsHMA`` declared, vLLM (0.32) keeps a model whose layers differ
in attention kind (Gemma 2/3, gpt-oss: full attention and sliding-window
layers) in several KV cache groups, one block table each.  A sliding-window
group (``SlidingWindowSpec``) keeps blocks only for the last
``sliding_window - 1`` tokens before the next one to compute: blocks before
that are freed and replaced by the *null block* (block id 0) in the
request's block table, at the next step's scheduling
(``remove_skipped_blocks``); a request that starts from an external hit gets
null blocks for the out-of-window part of the hit from the start.

What the connector stores, and why that is correct:

- A chunk payload is the same with the hybrid manager on or off: every
  layer's K and V of every token of the chunk, layers in model order
  (:class:`~lmcache_client.integrations.chunklayout.ChunkLayout`).  A layer's
  bytes are its K/V whatever group it sits in, so a payload is never read as
  another layer's, and a replica with the hybrid manager off serves one with
  it on and back.  Layers are never mixed up: each group's copier takes its
  own layers' rows of the payload (:class:`GroupCopier`).
- **Saves**: a chunk is stored only when every sliding-window group still
  holds real blocks for all its tokens (vLLM computed them in this step, or
  recently enough that they are inside the window).  The first chunk that
  fails this ends the request's saves (later chunks would be unreachable by
  a prefix lookup).  With long prompts split over several steps and a window
  shorter than a chunk plus a block, a chunk straddling a step boundary can
  lose its early tokens' blocks before it is complete: its prefix then stops
  there (a smaller hit, never a wrong one).  Asynchronous saves of such a
  model finish before the next step's forward pass (``handle_preemptions``),
  since the next step's scheduling may hand the window's old blocks out.
- **Loads** write every token of the loaded range into each full-attention
  group, and into each sliding-window group only the tokens whose block is
  real: the null block is never read or written.  vLLM gives the hit's last
  window real blocks, so the next token attends to exactly what it would
  after computing the prefix itself.
- **Failures**: vLLM 0.32 refuses block-level load errors with more than one
  group; a failed or partial load is reported per request
  (``failed_recving``) and vLLM recomputes the request.  That needs
  asynchronous loads (the request waits in ``WAITING_FOR_REMOTE_KVS``), so a
  multi-group model with ``async_transfers: false`` is refused at start.

Spec kinds the connector understands: ``FullAttentionSpec``,
``SlidingWindowSpec`` and (a group of its own, :mod:`.mla`)
``MLAAttentionSpec``; a Mamba hybrid's ``MambaSpec`` groups are taken off
by :mod:`.states` before these checks (their state moves on the side; one
outside align mode is refused there).  Any other kind (chunked local attention,
cross attention, DeepSeek's compressed or sparse caches, ...) is refused at
start with one message naming every such group (:func:`check_groups`).

The worker moves a token range through :class:`GroupSlots` whatever the
number of groups (one group: a single :class:`GroupCopier` over every layer),
one by one (``scatter``/``gather``) or as :class:`~..batched.Part` s for a
batch of copies per group (``scatter_parts``/``gather_parts``), the same
tokens either way.

Primitives: :class:`GroupInfo`, :func:`check_groups`, :func:`group_infos`,
:func:`savable`, :class:`GroupCopier`, :class:`GroupSlots`, :func:`group_slots`,
:data:`NULL_BLOCK`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ..batched import Part
from ..paged import Slots, token_slots

NULL_BLOCK = 0
"""vLLM's null block id: the placeholder for a sliding-window group's out-of-window blocks."""

FULL, SLIDING, MLA = "full", "sliding", "mla"
_KINDS = {"FullAttentionSpec": FULL, "SlidingWindowSpec": SLIDING, "MLAAttentionSpec": MLA}
"""vLLM spec class name -> what the connector does with it (exact class: subclasses differ)."""


class UnsupportedGroups(ValueError):
    """vLLM's KV cache groups include a kind this connector does not understand."""


@dataclasses.dataclass(frozen=True)
class GroupInfo:
    """One of vLLM's KV cache groups, as the connector sees it."""

    kind: str
    """``full``, ``sliding`` or ``mla``."""
    block_size: int
    layer_names: tuple[str, ...]
    sliding_window: int = 0
    """Tokens a sliding-window group attends to (0: all)."""
    extra_retained_tokens: int = 0

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens whose blocks vLLM has nulled once ``num_computed_tokens`` are
        computed (vLLM's ``SlidingWindowManager.get_num_skipped_tokens``; 0 for full attention)."""
        if self.kind != SLIDING:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens)


def _kind(spec: Any) -> str | None:
    return _KINDS.get(type(spec).__name__)


def check_groups(kv_cache_config: Any) -> None:
    """Refuse, in one message naming each, the groups whose spec kind the connector does
    not understand.  A config without groups (stand-ins, old vLLM) passes."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    unknown = [
        f"group {i} ({type(g.kv_cache_spec).__name__}, {len(g.layer_names)} layers"
        f"{', e.g. ' + g.layer_names[0] if g.layer_names else ''})"
        for i, g in enumerate(groups)
        if _kind(g.kv_cache_spec) is None
    ]
    if unknown:
        raise UnsupportedGroups(
            "lmcache-server connector cannot serve this model's KV cache, whose groups include a kind it "
            "does not understand: " + "; ".join(unknown) + " (it serves FullAttentionSpec, SlidingWindowSpec "
            "and MLAAttentionSpec groups)"
        )


def group_infos(kv_cache_config: Any) -> list[GroupInfo]:
    """Every group of ``kv_cache_config`` (after :func:`check_groups`), in vLLM's order."""
    check_groups(kv_cache_config)
    out = []
    for g in list(getattr(kv_cache_config, "kv_cache_groups", None) or []):
        spec = g.kv_cache_spec
        kind = _kind(spec)
        assert kind is not None
        window = int(getattr(spec, "sliding_window", 0) or 0) if kind == SLIDING else 0
        extra = int(getattr(spec, "extra_retained_tokens", 0) or 0) if kind == SLIDING else 0
        out.append(GroupInfo(kind, int(spec.block_size), tuple(g.layer_names), window, extra))
    return out


def savable(groups: Sequence[GroupInfo], start: int, computed_before: int) -> bool:
    """Whether every sliding-window group still holds real blocks for tokens from
    ``start`` on, in a step that began with ``computed_before`` tokens computed (vLLM
    nulls whole blocks below ``skipped_tokens(computed_before)`` when it schedules it)."""
    for g in groups:
        if g.kind == SLIDING and start // g.block_size < g.skipped_tokens(computed_before) // g.block_size:
            return False
    return True


def split_groups(block_ids: Any) -> list[list[int]]:
    """Per-group block id lists from what vLLM passes (a tuple of lists; a flat list: one group)."""
    if not block_ids:
        return []
    if isinstance(block_ids[0], list | tuple):
        return [list(ids) for ids in block_ids]
    return [list(block_ids)]


class GroupCopier:
    """Moves one group's layers between the paged cache and the rows of a whole-model
    payload ``(layers, 2, tokens, heads, dim)`` that hold them (model order)."""

    def __init__(self, info: GroupInfo, rows: list[int], copier: Any):
        import torch

        self.info = info
        self.rows = rows
        self.copier = copier
        self._index = torch.tensor(rows, dtype=torch.long)
        self._contiguous = rows == list(range(rows[0], rows[0] + len(rows)))

    def _select(self, payload: Any) -> Any:
        if self._contiguous:
            return payload[self.rows[0] : self.rows[0] + len(self.rows)]
        return payload.index_select(0, self._index.to(payload.device))

    def scatter(self, slots: Any, payload: Any) -> None:
        """Write this group's rows of ``payload`` into the tokens at ``slots``."""
        self.copier.scatter(slots, self._select(payload))

    def gather(self, slots: Any, payload: Any) -> None:
        """Read the tokens at ``slots`` into this group's rows of ``payload``."""
        if self._contiguous:
            self.copier.gather(slots, payload[self.rows[0] : self.rows[0] + len(self.rows)])
            return
        import torch

        staging = torch.empty((len(self.rows), *payload.shape[1:]), dtype=payload.dtype, device=self.copier.device)
        self.copier.gather(slots, staging)
        payload.index_copy_(0, self._index.to(payload.device), staging.to(payload.device))

    def scatter_part(self, slots: Slots, payload: Any) -> Part:
        """:meth:`scatter` as a part of a batch of this group's copies (read at the batch)."""
        return Part(slots, self._select(payload))

    def gather_part(self, slots: Slots, payload: Any) -> tuple[Part, Callable[[], None] | None]:
        """:meth:`gather` as a part of a batch of this group's copies, and what to run
        once the batch is done: rows spread over the payload are gathered into a
        staging tensor of their own, copied into their rows then."""
        if self._contiguous:
            return Part(slots, payload[self.rows[0] : self.rows[0] + len(self.rows)]), None
        import torch

        staging = torch.empty((len(self.rows), *payload.shape[1:]), dtype=payload.dtype, device=payload.device)
        index = self._index.to(payload.device)
        return Part(slots, staging), lambda: payload.index_copy_(0, index, staging)


class GroupSlots:
    """Where each group keeps the tokens of one range: ``(copier, slots, real)`` per group,
    ``real`` a boolean mask of the tokens in real blocks (None: all of them)."""

    def __init__(self, parts: list[tuple[GroupCopier, Any, Any]]):
        self.parts = parts

    def __getitem__(self, part: slice) -> GroupSlots:
        """Tokens ``part`` of the range."""
        return GroupSlots(
            [
                (g, Slots(s.blocks[part], s.offsets[part]), None if real is None else real[part])
                for g, s, real in self.parts
            ]
        )

    def complete(self) -> bool:
        """Whether every group holds every token of the range in a real block."""
        return all(real is None or bool(real.all()) for _, _, real in self.parts)

    def scatter(self, payload: Any) -> None:
        """Write ``payload`` ``(layers, 2, tokens, heads, dim)``: every group its own
        layers, a sliding-window group only the tokens in real blocks."""
        for g, s, real in self.parts:
            if real is None or bool(real.all()):
                g.scatter(s, payload)
            elif bool(real.any()):
                g.scatter(Slots(s.blocks[real], s.offsets[real]), payload[:, :, real.to(payload.device)])

    def gather(self, payload: Any) -> None:
        """Read every group's layers into ``payload``; refuses a range with null blocks."""
        if not self.complete():
            raise ValueError("a sliding-window group holds null blocks in this range")
        for g, s, _ in self.parts:
            g.gather(s, payload)

    def scatter_parts(self, payload: Any) -> list[Part | None]:
        """:meth:`scatter` as one part per group for its batch of copies (None: no token
        of the range in a real block of that group): exactly the tokens it writes."""
        out: list[Part | None] = []
        for g, s, real in self.parts:
            if real is None or bool(real.all()):
                out.append(g.scatter_part(s, payload))
            elif bool(real.any()):
                out.append(
                    g.scatter_part(Slots(s.blocks[real], s.offsets[real]), payload[:, :, real.to(payload.device)])
                )
            else:
                out.append(None)
        return out

    def gather_parts(self, payload: Any) -> list[tuple[Part, Callable[[], None] | None]]:
        """:meth:`gather` as one part per group for its batch of copies, each with what to
        run once its batch is done (:meth:`GroupCopier.gather_part`)."""
        if not self.complete():
            raise ValueError("a sliding-window group holds null blocks in this range")
        return [g.gather_part(s, payload) for g, s, _ in self.parts]


def group_slots(
    groups: Sequence[GroupCopier],
    group_block_ids: Sequence[Sequence[int]],
    start: int,
    end: int,
    block_size: int,
    block_tokens: int,
) -> GroupSlots:
    """Per-group slots of tokens ``[start, end)`` of a request whose blocks, per group,
    are ``group_block_ids`` (a sliding-window group's null blocks are masked out)."""
    import torch

    if len(group_block_ids) != len(groups):
        raise ValueError(f"{len(group_block_ids)} block lists for {len(groups)} KV cache groups")
    parts = []
    for g, ids in zip(groups, group_block_ids):
        real = None
        if g.info.kind == SLIDING:
            index = torch.arange(start, end) // block_size
            table = torch.tensor(list(ids), dtype=torch.long)
            real = table[index.clamp(max=max(len(ids) - 1, 0))] != NULL_BLOCK if len(ids) else None
            if real is not None and bool(real.all()):
                real = None
        # a null block's slots are computed like any other; they are masked out, never touched
        parts.append((g, token_slots(list(ids), start, end, block_size, block_tokens), real))
    return GroupSlots(parts)
