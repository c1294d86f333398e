"""The KV-event wire format of vLLM 0.32 (``vllm/distributed/kv_events.py``), encoded with msgpack.

A message on the PUB socket is ``[topic, seq, payload]``: ``seq`` an unsigned
64-bit big-endian batch number, ``payload`` a msgpack array
``[ts, events, data_parallel_rank]`` (vLLM's ``KVEventBatch``, an array-like
struct).  Each event is a msgpack map tagged ``"type"`` (vLLM's tagged
``KVCacheEvent`` structs); its required fields are always present, the
optional ones (defaults in vLLM) are left out:

- ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name;
- ``BlockRemoved``: block_hashes, medium;
- ``AllBlocksCleared``: no fields.

Primitives: :func:`block_stored`, :func:`block_removed`, :func:`all_cleared`,
:func:`encode_batch`, :func:`seq_bytes`, :data:`END_SEQ`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

Event = dict[str, Any]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame of the replay endpoint's end-of-replay marker."""


def block_stored(
    hashes: Sequence[int], parent: int | None, token_ids: Sequence[int], block_size: int, medium: str
) -> Event:
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(token_ids),
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


def block_removed(hashes: Sequence[int], medium: str) -> Event:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}


def all_cleared() -> Event:
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: Sequence[Event], data_parallel_rank: int = 0) -> bytes:
    """One ``KVEventBatch`` payload."""
    payload: bytes = msgpack.packb([ts, list(events), data_parallel_rank], use_bin_type=True)
    return payload


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")
