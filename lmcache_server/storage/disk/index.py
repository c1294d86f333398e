"""The disk tier's index (:class:`DiskIndex`, a part :class:`.tier.DiskTier` builds and holds):
which chunks are on disk and their sizes, the byte counts (per namespace and
tenant), eviction to ``max_bytes`` and to each tenant's quota, and removal.

- An entry holds a chunk's sizes only; its file is ``path_for(root, key)``.
  Entries are shared between the chunks of one size (:func:`_entry`).
- Every insert, hit and removal is told to the eviction policy; a chunk that
  is neither indexed nor queued any more is told to the store (``links``).
- A read in flight over a key that is dropped or stored again meanwhile marks
  it changed (``changed``): a read that then fails found the old file.

Primitives: :class:`DiskIndex` (``add``, ``add_many``, ``drop``, ``left``, ``shrink_to``, ``shrink_tenant``,
``victim_for``, ``delete``, ``clear``, ``keys``, ``namespaces``),
:class:`DiskCounters`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import operator
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ..base import ChunkKey, TierLinks
from ..policy import EvictionPolicy
from ..tenants import TenantQuotas, tenant_of
from .files import HEADER_BLOCK, disk_usage, path_for, unlink
from .spillqueue import SpillQueue

logger = logging.getLogger("lmcache_server.storage.disk.tier")  # the tier's log lines keep their logger name


@dataclasses.dataclass(slots=True, frozen=True)
class _Entry:
    """A chunk's sizes; its file is ``path_for(root, key)``, so no path is kept (a
    million paths are 150 MB).  Shared between the chunks of one size: see :func:`_entry`."""

    payload_len: int
    disk_bytes: int


_entries: dict[tuple[int, int], _Entry] = {}


def _entry(payload_len: int, disk_bytes: int) -> _Entry:
    """The one entry of these sizes (chunks of a model are one size: no object per chunk)."""
    entry = _entries.get((payload_len, disk_bytes))
    if entry is None:
        entry = _Entry(payload_len, disk_bytes)
        if len(_entries) < 4096:
            _entries[(payload_len, disk_bytes)] = entry
    return entry


@dataclasses.dataclass
class DiskCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    stores: int = 0
    spills: int = 0
    spills_lent: int = 0  # queued without a copy: written straight from the memory pool
    spills_dropped: int = 0
    write_errors: int = 0
    corrupt: int = 0
    rebuilt_entries: int = 0
    rebuilt_from_snapshot: int = 0  # 1: the index came from the snapshot of a clean shutdown
    rebuild_seconds: float = 0.0


def _never(key: ChunkKey) -> bool:
    return False  # nothing on disk is leased: reads copy the record out


class DiskIndex:
    """The index of :class:`.tier.DiskTier`: the chunks under ``root`` (bounded by
    ``max_bytes`` and ``quotas``), told to ``policy``; ``spills`` are the chunks
    queued and not yet written; ``links`` is told when a chunk is no longer
    readable; files are removed through ``run`` (one hop to the I/O threads)."""

    def __init__(
        self,
        root: Path,
        max_bytes: int,
        *,
        counters: DiskCounters,
        quotas: TenantQuotas,
        policy: EvictionPolicy,
        spills: SpillQueue,
        links: TierLinks,
        run: Callable[..., Awaitable[Any]],
    ):
        self.root = root
        self.max_bytes = max_bytes
        self.counters = counters
        self.quotas = quotas
        self.policy = policy
        self.spills = spills
        self.links = links
        self._run = run
        self.entries: dict[ChunkKey, _Entry] = {}
        self.by_namespace: dict[str, list[int]] = {}
        # Keys with reads in flight (how many), and those of them stored or dropped since
        # a read began: a read that fails then found the old file, and the new one stays.
        self.reading: dict[ChunkKey, int] = {}
        self.changed: set[ChunkKey] = set()
        self.stored_bytes = 0  # payload bytes
        self.disk_bytes = 0  # as du counts them

    async def shrink_tenant(self, namespace: str) -> None:
        """Evict the namespace's tenant's own chunks while it is over its quota."""
        found = self.quotas.limit_for(namespace)
        if found is None:
            return
        tenant, limit = found

        def not_theirs(k: ChunkKey) -> bool:
            return tenant_of(k.namespace) != tenant

        while self.quotas.used(tenant) > limit and (key := self.policy.victim(not_theirs)) is not None:
            entry = self.entries[key]
            await self.drop(key, entry)
            self.counters.evictions += 1
            self.counters.evicted_bytes += entry.payload_len
            self.quotas.evictions[tenant] += 1

    async def shrink_to(self, limit: int) -> None:
        while self.disk_bytes > limit and (key := self.policy.victim(_never)) is not None:
            entry = self.entries[key]
            await self.drop(key, entry)
            self.counters.evictions += 1
            self.counters.evicted_bytes += entry.payload_len

    def victim_for(self, size: int) -> ChunkKey | None:
        """The chunk a write of ``size`` payload bytes would evict first, named but
        not evicted (None: it fits, after the spills queued before it)."""
        if self.disk_bytes + self.spills.nbytes + disk_usage(HEADER_BLOCK + size) <= self.max_bytes:
            return None
        return self.policy.victim(_never)

    # -- removal -------------------------------------------------------------------
    def left(self, key: ChunkKey) -> None:
        """Tell the store (``links``) when ``key`` is neither indexed nor queued any more."""
        listener = self.links.listener
        if listener is not None and key not in self.entries and key not in self.spills:
            listener.left_disk(key)

    def add(self, key: ChunkKey, entry: _Entry) -> None:
        namespace = sys.intern(key.namespace)  # one string per namespace, not one per chunk
        if namespace is not key.namespace:
            key = ChunkKey(namespace, key.digest)
        self.entries[key] = entry
        if key in self.reading:
            self.changed.add(key)
        self.policy.inserted(key, entry.payload_len, None)
        self.stored_bytes += entry.payload_len
        self.disk_bytes += entry.disk_bytes
        self.quotas.account(key.namespace, entry.disk_bytes)
        counts = self.by_namespace.setdefault(key.namespace, [0, 0])
        counts[0] += 1
        counts[1] += entry.payload_len

    def add_many(self, keys: list[ChunkKey], entries: list[_Entry]) -> None:
        """:meth:`add` of each ``(keys[i], entries[i])`` in order, in bulk (a restart
        from the snapshot: a million entries): the index and the policy take them
        in one call each, the byte counts are summed per namespace and entry.
        ``keys`` carry interned namespaces (storage/disk/snapshot.py)."""
        fresh = dict(zip(keys, entries))
        if len(fresh) != len(keys) or any(map(self.entries.__contains__, keys)):
            for key, entry in zip(keys, entries):  # a key twice, or one indexed already: one by one
                self.add(key, entry)
            return
        if self.entries:
            self.entries.update(fresh)
        else:
            self.entries = fresh
        inserted_many = getattr(self.policy, "inserted_many", None)
        if inserted_many is not None:
            inserted_many(keys)
        else:
            for key, entry in zip(keys, entries):
                self.policy.inserted(key, entry.payload_len, None)
        by_namespace = collections.Counter(zip(map(operator.attrgetter("namespace"), keys), map(id, entries)))
        kinds = dict(zip(map(id, entries), entries))  # the entries are shared per size: a few kinds
        for (namespace, kind), n in by_namespace.items():
            entry = kinds[kind]
            self.stored_bytes += n * entry.payload_len
            self.disk_bytes += n * entry.disk_bytes
            self.quotas.account(namespace, n * entry.disk_bytes)
            counts = self.by_namespace.setdefault(namespace, [0, 0])
            counts[0] += n
            counts[1] += n * entry.payload_len

    async def drop(self, key: ChunkKey, entry: _Entry) -> None:
        if self.entries.get(key) is not entry:
            return
        del self.entries[key]
        if key in self.reading:
            self.changed.add(key)
        self.policy.removed(key)
        self.stored_bytes -= entry.payload_len
        self.disk_bytes -= entry.disk_bytes
        self.quotas.account(key.namespace, -entry.disk_bytes)
        counts = self.by_namespace[key.namespace]
        counts[0] -= 1
        counts[1] -= entry.payload_len
        if counts[0] == 0:
            del self.by_namespace[key.namespace]
        self.left(key)
        try:
            await self._run(unlink, path_for(self.root, key))
        except OSError as err:
            logger.warning("disk tier: cannot remove %s: %s", path_for(self.root, key), err)

    async def delete(self, key: ChunkKey) -> bool:
        queued = self.spills.cancel(key)  # the writer skips it
        entry = self.entries.get(key)
        if entry is None:
            self.left(key)
            return queued
        await self.drop(key, entry)
        return True

    async def clear(self, namespace: str | None) -> int:
        queued = self.spills.cancel_namespace(namespace)
        for key in queued:
            self.left(key)
        victims = [(k, e) for k, e in self.entries.items() if namespace is None or k.namespace == namespace]
        for key, entry in victims:
            await self.drop(key, entry)
        return len(set(queued) | {k for k, _ in victims})

    def keys(self) -> list[ChunkKey]:
        return [*self.entries, *(k for k in self.spills if k not in self.entries)]

    def namespaces(self) -> dict[str, tuple[int, int]]:
        return {ns: (c[0], c[1]) for ns, c in self.by_namespace.items()}
