"""The KV-event wire format of vLLM 0.32 (``vllm/distributed/kv_events.py``), encoded with msgpack.

A message on the PUB socket is ``[topic, seq, payload]``: ``seq`` an unsigned
64-bit big-endian batch number, ``payload`` a msgpack array
``[ts, events, data_parallel_rank]`` (vLLM's ``KVEventBatch``, an array-like
struct).  Each event is a msgpack map tagged ``"type"`` (vLLM's tagged
``KVCacheEvent`` structs); its required fields are always present, the
optional ones (defaults in vLLM) are left out:

- ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, and the optional locality (``LOCAL``/``REMOTE``);
- ``BlockRemoved``: block_hashes, medium, locality;
- ``AllBlocksCleared``: no fields.

Each event is encoded once, when it is built (an :data:`Event` is its msgpack
bytes), and a batch is those bytes behind the batch's array header: no event
is packed twice, and a chunk's token ids go from the packed u32le bytes the
put carried straight to msgpack ``uint 32`` items (any integer width is valid
msgpack; vLLM's msgspec decoder takes them), without a Python int per token.

With ``events_encoding: array`` the same events go out as the positional
arrays of vLLM before 0.32 (:class:`Wire`), for routers that read only those.

Primitives: :func:`block_stored`, :func:`block_removed`, :func:`all_cleared`,
:class:`Wire` (the same in either encoding), :func:`encode_batch`,
:func:`seq_bytes`, :data:`END_SEQ`.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgpack

Event = bytes
"""One event, msgpack-encoded."""

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame of the replay endpoint's end-of-replay marker."""

_NIL = b"\xc0"


def _str(text: str) -> bytes:
    packed: bytes = msgpack.packb(text)
    return packed


_PACKER = msgpack.Packer(use_bin_type=True)
"""One packer for every event: ``msgpack.packb`` builds a new one per call.  (Its
``pack`` never releases the GIL, so it is never entered twice at once.)"""


def _pack(value: object) -> bytes:
    packed: bytes = _PACKER.pack(value)
    return packed


def _pack_hashes(hashes: Sequence[int]) -> bytes:
    """A msgpack array of ``hashes`` (a list, or the array('Q') an index keeps)."""
    items = hashes if type(hashes) is list else list(hashes)
    if len(items) > _PACKER_MAX_ITEMS:  # (the shared packer keeps the room its largest output took)
        packed: bytes = msgpack.packb(items)
        return packed
    return _pack(items)


_PACKER_MAX_ITEMS = 4096


_STORED = b"\x89" + _str("type") + _str("BlockStored")
_REMOVED = b"\x84" + _str("type") + _str("BlockRemoved")
_CLEARED = b"\x81" + _str("type") + _str("AllBlocksCleared")
_K = {name: _str(name) for name in (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "locality",
)}  # fmt: skip


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


_U32_BLANK: dict[int, tuple[bytes, bytearray]] = {}


def _u32_items(packed: bytes) -> tuple[bytes, bytearray]:
    """A msgpack array of the u32le integers in ``packed``, each as ``uint 32`` (0xce,
    big-endian), in two parts for a join: its header and its items."""
    n = len(packed) // 4
    blank = _U32_BLANK.get(n)
    if blank is None:
        # n items of 0xce and 4 bytes to fill, kept per n (a chunk's ids, a chunk's past its
        # shared blocks): a copy of it costs less than writing the 0xce bytes each time
        items = bytearray(5 * n)
        items[0::5] = b"\xce" * n
        blank = _U32_BLANK[n] = (_array_header(n), items)
        if len(_U32_BLANK) > 16:
            _U32_BLANK.pop(next(iter(_U32_BLANK)))
    head, out = blank[0], blank[1][:]
    out[1::5] = packed[3::4]
    out[2::5] = packed[2::4]
    out[3::5] = packed[1::4]
    out[4::5] = packed[0::4]
    return head, out


_TAILS: dict[tuple[int, str, str], bytes] = {}


def _stored_tail(block_size: int, medium: str, locality: str) -> bytes:
    """The fields of a ``BlockStored`` after its token ids (the same for every event of a topic and medium)."""
    tail = _TAILS.get((block_size, medium, locality))
    if tail is None:
        k = _K
        tail = b"".join((
            k["block_size"], _pack(block_size),
            k["lora_id"], _NIL,
            k["medium"], _str(medium),
            k["lora_name"], _NIL,
            k["locality"], _str(locality),
        ))  # fmt: skip
        _TAILS[(block_size, medium, locality)] = tail
    return tail


_HEAD = _STORED + _K["block_hashes"]
_PARENT = _K["parent_block_hash"]
_IDS = _K["token_ids"]


def block_stored(
    hashes: Sequence[int], parent: int | None, packed_ids: bytes, block_size: int, medium: str, locality: str = "LOCAL"
) -> Event:
    """``packed_ids``: the blocks' token ids, u32le (as puts carry them)."""
    return b"".join((
        _HEAD, _pack_hashes(hashes),
        _PARENT, _NIL if parent is None else _pack(parent),
        _IDS, *_u32_items(packed_ids),
        _stored_tail(block_size, medium, locality),
    ))  # fmt: skip


def block_removed(hashes: Sequence[int], medium: str, locality: str = "LOCAL") -> Event:
    k = _K
    return b"".join((
        _REMOVED, k["block_hashes"], _pack_hashes(hashes), k["medium"], _str(medium), k["locality"], _str(locality),
    ))  # fmt: skip


def all_cleared() -> Event:
    return _CLEARED


def encode_batch(ts: float, events: Sequence[Event], data_parallel_rank: int = 0) -> bytes:
    """One ``KVEventBatch`` payload: ``[ts, [events...], data_parallel_rank]``."""
    return b"".join((b"\x93", _pack(float(ts)), _array_header(len(events)), *events, _pack(data_parallel_rank)))


class Wire:
    """The event builders in one encoding: vLLM 0.32's maps (``array`` False, the
    functions above) or the positional arrays vLLM encoded before 0.32 (msgspec's
    ``array_like``), which llm-d's vLLM adapter and Mooncake Conductor decode:
    ``[tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id,
    medium, lora_name]``, ``[tag, block_hashes, medium]`` and ``[tag]``.  That
    form has no ``locality``: it is left out (every event is this node's own)."""

    def __init__(self, array: bool = False):
        self.array = array

    def block_stored(
        self,
        hashes: Sequence[int],
        parent: int | None,
        packed_ids: bytes,
        block_size: int,
        medium: str,
        locality: str = "LOCAL",
    ) -> Event:
        if not self.array:
            return block_stored(hashes, parent, packed_ids, block_size, medium, locality)
        return b"".join((
            b"\x98", _TAGS["BlockStored"], _pack_hashes(hashes),
            _NIL if parent is None else _pack(parent),
            *_u32_items(packed_ids), _pack(block_size), _NIL, _str(medium), _NIL,
        ))  # fmt: skip

    def block_removed(self, hashes: Sequence[int], medium: str, locality: str = "LOCAL") -> Event:
        if not self.array:
            return block_removed(hashes, medium, locality)
        return b"\x93" + _TAGS["BlockRemoved"] + _pack_hashes(hashes) + _str(medium)

    def all_cleared(self) -> Event:
        return b"\x91" + _TAGS["AllBlocksCleared"] if self.array else _CLEARED


_TAGS = {tag: _str(tag) for tag in ("BlockStored", "BlockRemoved", "AllBlocksCleared")}


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")
