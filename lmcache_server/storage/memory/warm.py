"""The memory tier's side of a warm restart (storage/memory/warmstart.py): the list of
stored chunks a clean stop leaves, and the adoption of that list by the next
daemon's tier over the same pool.

Primitives: :func:`snapshot`, :func:`adopt`, :func:`held_chunk`; the tier's
methods of the same names call them, passing in the tier's index as a
:class:`WarmTier` (the state these functions work on; this module does not
import the tier or its index).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from ..base import Chunk, ChunkKey
from ..policy import EvictionPolicy
from .allocator import ExtentAllocator, extent_of
from .entry import Entry, canonical, pack, packable, shared, unpack

logger = logging.getLogger(__name__)


class AdoptedCount(Protocol):
    adopted: int


class WarmTier(Protocol):
    """The parts of the memory tier's index (:class:`.index.ChunkIndex`) a warm restart
    reads and sets."""

    entries: dict[ChunkKey, int | Entry]
    evictable_bytes: int
    dying_bytes: int

    @property
    def allocator(self) -> ExtentAllocator: ...
    @property
    def policy(self) -> EvictionPolicy: ...
    @property
    def counters(self) -> AdoptedCount: ...

    def account(self, key: ChunkKey, size: int, sign: int) -> None: ...

    def lease_entry(self, entry: Entry) -> Chunk: ...


def snapshot(tier: WarmTier) -> list[tuple[ChunkKey, int, int, bool]]:
    """Every chunk ``tier`` stores as ``(key, offset, size, pinned)``, next victim
    first (pinned chunks last)."""
    index = tier.entries

    def unpinned(k: ChunkKey) -> bool:
        found = index.get(k)
        return found is not None and (isinstance(found, int) or not found.pinned)

    order = [k for k in tier.policy.order() if unpinned(k)]
    listed = set(order)
    order += [k for k in index if k not in listed]
    rows = []
    for k in order:
        found = index[k]
        if isinstance(found, int):
            rows.append((k, *unpack(found), False))
        else:
            rows.append((k, found.offset, found.size, found.pinned))
    return rows


def adopt(
    tier: WarmTier,
    chunks: Sequence[tuple[ChunkKey, int, int, bool]],
    held: Sequence[tuple[int, int]],
    pin: Callable[[ChunkKey], bool],
) -> None:
    """Make an empty ``tier`` take over a pool left by a clean stop: ``chunks`` as
    :func:`snapshot` gave them (inserted in that order: the policy keeps it) and
    the extents ``(offset, size)`` of leases carried over, allocated until given
    back (``abort``, or the release of :func:`held_chunk`).  Each chunk is
    charged as ``tier`` charges (its extent, under this configuration's quotas
    and pin bounds): a chunk pinned before past those bounds is adopted
    unpinned (evictable; ``pin`` pins one, False past those bounds).  ValueError when the tier is not empty or extents
    overlap or leave the pool."""
    if tier.entries:
        raise ValueError("only an empty memory tier can adopt a pool")
    extents = [(offset, extent_of(size)) for _, offset, size, _ in chunks]
    tier.allocator.occupy(extents + [(o, extent_of(n)) for o, n in held])
    index = tier.entries
    unpinned = 0
    for key, offset, size, pinned in chunks:
        if key in index:
            raise ValueError(f"chunk {key.digest.hex()} is listed twice")
        key = canonical(key)
        index[key] = pack(offset, size) if packable(offset, size) else Entry(key, offset, shared(size), extent_of(size))
        tier.evictable_bytes += extent_of(size)
        tier.policy.inserted(key, size, None)
        tier.account(key, size, +1)  # charged as this daemon charges: extents, this config's quotas
        if pinned and not pin(key):  # re-checked: past this config's pin room it stays, unpinned
            unpinned += 1
    if unpinned:
        logger.warning(
            "warm restart: %d chunks pinned before the restart were adopted unpinned "
            "(past max_pinned_fraction or their tenant's share of it)",
            unpinned,
        )
    tier.counters.adopted = len(chunks)


def held_chunk(tier: WarmTier, offset: int, size: int, held: dict[int, Entry] | None = None) -> Chunk:
    """A leased view of a held extent of a read lease whose chunk is gone (deleted
    or evicted before the restart), freed when its last lease ends.  ``held``: the
    entries made so far by offset, shared by every slot on the same extent (two
    leases on one deleted chunk, or one lease naming it twice): one entry per
    extent, leased once per slot, so the extent is freed exactly once."""
    entry = held.get(offset) if held is not None else None
    if entry is None:
        entry = Entry(ChunkKey("", b""), offset, size, extent_of(size), dead=True)
        tier.dying_bytes += entry.extent
        if held is not None:
            held[offset] = entry
    elif entry.size != size:
        raise ValueError(f"two leases hold different extents at offset {offset}")
    return tier.lease_entry(entry)
