"""What the announcer knew at a clean stop, so the next start can announce it again.

Token ids reach the daemon only with puts; the chunk files and the warm memory
index do not hold them (their formats are not changed for events).  At a
clean stop the announcer writes, per announced chunk, its namespace, key,
block hashes, parent hash, token ids and parent key to ``path`` (msgpack records behind a
version header, written to a temporary file and renamed).  At the next start
the records are read once (the file is removed), and a record is announced
again only if the store holds its key then (a warm restart adopted the
memory tier, or the disk tier found its file): the router learns the node's
residency without waiting for puts.  A file that cannot be read is logged and
ignored (the start is then cold for events).

Primitives: :func:`keep_path`, :func:`save`, :func:`load`, :class:`Kept`.
"""

from __future__ import annotations

import hashlib
import logging
import os
from array import array
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import msgpack

from ..storage.base import ChunkKey
from .blocks import Held

logger = logging.getLogger(__name__)

HEADER = b"lmcache-events-kept-v2\n"
"""Version 2 adds each chunk's parent key; a version 1 file (an older daemon's) still loads."""
HEADER_V1 = b"lmcache-events-kept-v1\n"


class Kept(NamedTuple):
    key: ChunkKey
    held: Held


def keep_path(spill_dir: Path | None, shm_dir: str, listen: Sequence[str]) -> Path:
    """In the disk tier's directory (its files outlive a reboot), else in ``shm_dir``
    under a name of the daemon's listen addresses (like the warm index)."""
    if spill_dir is not None:
        return spill_dir / "events-kept.msgpack"
    tag = hashlib.sha256("\n".join(listen).encode()).hexdigest()[:16]
    return Path(shm_dir) / f"lmcache-events-kept-{tag}.msgpack"


def save(path: Path | None, chunks: Iterable[Kept]) -> int:
    """Write ``chunks``; returns how many (0 and logged when the file cannot be written)."""
    if path is None:
        return 0
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    try:
        with open(tmp, "wb") as f:
            f.write(HEADER)
            packer = msgpack.Packer(use_bin_type=True)
            for key, held in chunks:
                parent = -1 if held.parent is None else held.parent
                record = (key.namespace, key.digest, parent, held.hashes.tobytes(), held.packed, held.parent_key)
                f.write(packer.pack(record))
                n += 1
        os.replace(tmp, path)
    except OSError as err:
        logger.warning("KV events: what was announced could not be kept for the next start (%s)", err)
        tmp.unlink(missing_ok=True)
        return 0
    return n


def load(path: Path | None) -> list[Kept]:
    """The records of the last clean stop (the file is removed); [] when there are none."""
    if path is None:
        return []
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as err:
        logger.warning("KV events: %s not read (%s); chunks found at start are not announced", path, err)
        return []
    path.unlink(missing_ok=True)
    if not data.startswith((HEADER, HEADER_V1)):
        logger.warning("KV events: %s is not a kept-events file; ignored", path)
        return []
    out = []
    try:
        for namespace, digest, parent, hashes, packed, parent_key in _records(data[len(HEADER) :]):
            held = Held(_hashes(hashes), None if parent < 0 else parent, packed, parent_key)
            out.append(Kept(ChunkKey(namespace, digest), held))
    except (ValueError, TypeError, msgpack.UnpackException) as err:
        logger.warning("KV events: %s is damaged (%s); %d chunks read before it", path, err, len(out))
    return out


def _records(data: bytes) -> Iterable[tuple[str, bytes, int, bytes, bytes, bytes]]:
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
        yield namespace, digest, int(parent), bytes(hashes), packed, parent_key


def _hashes(raw: bytes) -> array[int]:
    hashes = array("Q")
    hashes.frombytes(raw)
    return hashes
