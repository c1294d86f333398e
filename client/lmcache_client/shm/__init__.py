"""The same-host data path: the daemon's memory pool mapped into this process.

A daemon whose pool lives in a shared-memory segment offers it in its hello
reply (``shm``: path, size, segment token, lease timeout, its monotonic
clock).  A client on the same host maps it (:meth:`SharedPool.open`; a client
elsewhere cannot open the path and keeps using payload frames), then:

- **get**: the reply holds each hit's (offset, length) under a read lease; the
  client copies the bytes straight into their destination (a buffer or a
  torch tensor: one memcpy, or one DMA for a CUDA tensor once the mapping is
  registered with ``cudaHostRegister``) and releases the lease.
- **put**: ``alloc`` reserves a slot per chunk under a write lease, the client
  copies its bytes in, ``commit`` makes them visible.  The commit also asks
  for *staged slots* (``stage``: anonymous pool room sized for the next put,
  under a write lease of its own); a later put whose sizes match them copies
  straight into them and sends one ``bind`` (bind to keys and commit), whose
  reply stages fresh slots in place of those consumed: a stream of puts is
  one round trip each.  A put that does not fit the staged slots (or finds
  their lease near its deadline, or refused) takes alloc+commit, with the
  same results.

Leases end at a deadline on CLOCK_MONOTONIC, which both processes read on one
host.  A copy finished before the deadline (less a safety margin) was made
under a live lease, so the release need not wait for an answer; otherwise the
client asks, and a chunk whose lease lapsed is a miss (its bytes may have
been reused).  When the clocks disagree (a time namespace) every release is
confirmed.

The flows are written once, as generators that yield the calls to make
(:class:`Ask`: wait for the reply, :class:`Tell`: send and do not wait), and
are driven by the sync and asyncio clients alike.

Zero-copy variants for callers that produce or consume the bytes themselves
(an engine adapter gathering KV straight out of its paged cache):
:func:`fill_flow` hands each reserved slot to a ``fill(i, view)`` callback
before committing, :func:`use_flow` hands each leased hit to ``use(i, view)``
before releasing.

Where each job lives (this package is the client's same-host room):
:mod:`~lmcache_client.shm.path` (a client's path: the mapping and the flows
driven over its connection, sync and asyncio), :mod:`~lmcache_client.shm.pool`
(the mapping), :mod:`~lmcache_client.shm.flows` (what a flow yields, failures,
the lease owner), :mod:`~lmcache_client.shm.get` (the get flows),
:mod:`~lmcache_client.shm.put` (the put flows) and
:mod:`~lmcache_client.shm.staged` (the staged-slot stream).  This module is
their face: the names below are importable from here.

Primitives: :class:`SharedMemoryPath`, :class:`AsyncSharedMemoryPath`,
:class:`SharedPool`, :func:`get_flow`, :func:`put_flow`, :func:`fill_flow`,
:func:`use_flow`, :class:`Ask`, :class:`Tell`.
"""

from __future__ import annotations

from .flows import DEADLINE_MARGIN_S as DEADLINE_MARGIN_S
from .flows import MISS as MISS
from .flows import RAISE as RAISE
from .flows import REMAP as REMAP
from .flows import Ask as Ask
from .flows import Flow as Flow
from .flows import Tell as Tell
from .flows import on_failure as on_failure
from .flows import owner as owner
from .get import FlushFn as FlushFn
from .get import UseFn as UseFn
from .get import copy_frame as copy_frame
from .get import get_flow as get_flow
from .get import use_flow as use_flow
from .get import use_frames as use_frames
from .path import AsyncSharedMemoryPath as AsyncSharedMemoryPath
from .path import SharedMemoryPath as SharedMemoryPath
from .pool import PARALLEL_COPY_MIN_BYTES as PARALLEL_COPY_MIN_BYTES
from .pool import SAME_CLOCK_TOLERANCE_S as SAME_CLOCK_TOLERANCE_S
from .pool import Mapping as Mapping
from .pool import SharedPool as SharedPool
from .pool import StagedSlots as StagedSlots
from .put import PUT_MIN_BYTES as PUT_MIN_BYTES
from .put import FillFn as FillFn
from .put import fill_flow as fill_flow
from .put import put_flow as put_flow
from .staged import WriteFn as WriteFn
from .staged import _put_staged as _put_staged  # for tests/server/shm/test_write_leases.py
from .staged import parting as parting
