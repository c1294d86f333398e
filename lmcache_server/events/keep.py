"""What the announcer knew at a clean stop, so the next start can announce it again.

Token ids reach the daemon only with puts; the chunk files and the warm memory
index do not hold them (their formats are not changed for events).  At a
clean stop the announcer writes, per announced chunk, its namespace, key,
block hashes, parent hash, token ids and parent key to ``path`` (msgpack records
behind a version header) in the daemon's private state directory
(:mod:`..storage.statefiles`: a 0600 temporary file of a random name, then a
rename; never the world-writable ``shm_dir``, where another user could read
every tenant's prompts from a file it planted).  At the next start the records
are read once (only a regular file of this user; the file is removed), and a
record is announced again only if its token ids hash to its key
(``chain_key(parent key, ids) == key``, as a put's are checked) and the store
holds its key then (a warm restart adopted the memory tier, or the disk tier
found its file): the router learns the node's residency without waiting for
puts.  Its block hashes are computed again from the ids, never taken from the
file.  A record of the older format (no parent key) cannot be checked and is
not announced; a file that cannot be read is logged and ignored (the start is
then cold for events).

Primitives: :func:`keep_path`, :func:`save`, :func:`load`, :class:`Kept`.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import msgpack

from lmcache_client.keys import KEY_DOMAIN

from ..storage.base import ChunkKey
from ..storage.statefiles import StateDir, read_private, remove, write_private
from .blocks import Held, block_hashes, parent_hash

logger = logging.getLogger(__name__)

HEADER = b"lmcache-events-kept-v2\n"
"""Version 2 adds each chunk's parent key; a version 1 file (an older daemon's) is read, its records
(which cannot be checked against their keys) are not announced."""
HEADER_V1 = b"lmcache-events-kept-v1\n"
MAX_BYTES = 8 << 30
"""A bound on the file read at start (it holds every announced chunk's token ids)."""


class Kept(NamedTuple):
    key: ChunkKey
    held: Held


def keep_path(state: StateDir | None) -> Path | None:
    """In the daemon's private state directory (the spill directory when there is
    one: its files outlive a reboot); None: nothing is kept."""
    return None if state is None else state.file("events-kept", ".msgpack")


def save(path: Path | None, chunks: Iterable[Kept]) -> int:
    """Write ``chunks``; returns how many (0 and logged when the file cannot be
    written: never raises, the stop goes on to close the store)."""
    if path is None:
        return 0
    n = 0
    try:
        with write_private(path) as f:
            f.write(HEADER)
            packer = msgpack.Packer(use_bin_type=True)
            for key, held in chunks:
                parent = -1 if held.parent is None else held.parent
                record = (key.namespace, key.digest, parent, held.hashes.tobytes(), held.packed, held.parent_key)
                f.write(packer.pack(record))
                n += 1
    except Exception as err:  # any failure here is one line: the clean stop must still close the store
        logger.warning("KV events: what was announced could not be kept for the next start (%s)", err)
        return 0
    return n


def load(path: Path | None) -> list[Kept]:
    """The records of the last clean stop that hash to their keys (the file is
    removed); [] when there are none."""
    if path is None:
        return []
    try:
        data = read_private(path, MAX_BYTES)
    except OSError as err:
        logger.warning("KV events: %s not read (%s); chunks found at start are not announced", path, err)
        return []
    if data is None:
        return []
    remove(path, "the kept KV events file")
    if not data.startswith((HEADER, HEADER_V1)):
        logger.warning("KV events: %s is not a kept-events file; ignored", path)
        return []
    out: list[Kept] = []
    unchecked = 0
    try:
        for namespace, digest, hashes, packed, parent_key in _records(data[len(HEADER) :]):
            held = _checked(digest, hashes, packed, parent_key)
            if held is None:
                unchecked += 1
            else:
                out.append(Kept(ChunkKey(namespace, digest), held))
    except (ValueError, TypeError, msgpack.UnpackException) as err:
        logger.warning("KV events: %s is damaged (%s); %d chunks read before it", path, err, len(out))
    if unchecked:
        logger.warning(
            "KV events: %d kept records of %s are not announced: their token ids do not hash to their keys "
            "(or an older daemon kept them without parent keys)",
            unchecked,
            path,
        )
    return out


def _checked(digest: bytes, hashes: bytes, packed: bytes, parent_key: bytes) -> Held | None:
    """The record's :class:`Held`, its block hashes computed from its ids (None: the ids
    and parent key do not hash to ``digest``, or its blocks do not divide its ids)."""
    if len(parent_key) != 32 or hashlib.sha256(KEY_DOMAIN + parent_key + packed).digest() != digest:
        return None
    blocks = len(hashes) // 8
    if not blocks or len(packed) % (4 * blocks):
        return None
    block_size = len(packed) // 4 // blocks
    if not block_size:
        return None
    fresh = array("Q", block_hashes(digest, parent_key, packed, block_size))
    return Held(fresh, parent_hash(parent_key), packed, parent_key)


def _records(data: bytes) -> Iterable[tuple[str, bytes, bytes, bytes, bytes]]:
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(data) + 1)
    unpacker.feed(data)
    for record in unpacker:
        if not isinstance(record, list) or len(record) not in (5, 6):
            raise ValueError("a record of the wrong shape")
        namespace, digest, parent, hashes, packed = record[:5]
        parent_key = record[5] if len(record) == 6 else b""
        if not all(isinstance(v, bytes) for v in (digest, packed, parent_key)) or not isinstance(namespace, str):
            raise ValueError("a record of the wrong shape")
        if parent_key and len(parent_key) != 32:
            raise ValueError("a parent key that is not 32 bytes")
        int(parent)  # the shape is checked; the value is computed again from the parent key
        yield namespace, digest, bytes(hashes), packed, parent_key
