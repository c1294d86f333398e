"""A router's side of KV events, for the tests: the snapshot request and an index
built from batches (what llm-d's or Dynamo's indexer keeps: per topic and
medium, each block's parent and token ids).

:func:`snapshot` asks the snapshot endpoint (docs/events.md, "Snapshot");
:class:`RouterIndex` applies decoded batches (msgpack maps, vLLM's field names).
"""

from __future__ import annotations

from typing import Any

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)

Frames = tuple[bytes, int, bytes]  # topic, seq, payload
Block = tuple[int | None, tuple[int, ...], str]  # parent hash, token ids, locality


def snapshot(endpoint: str, prefix: bytes = b"", timeout_ms: int = 20_000) -> tuple[dict[str, Any], list[Frames]]:
    """The header's meta and the snapshot's batches."""
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send_multipart([b"", prefix])
        assert sock.poll(timeout_ms), "the snapshot endpoint did not answer"
        empty, topic, seq, raw = sock.recv_multipart()
        assert empty == b"" and topic == b""
        meta: dict[str, Any] = msgpack.unpackb(raw, raw=False)
        assert int.from_bytes(seq, "big") == meta["seq"]
        out = []
        while True:
            assert sock.poll(timeout_ms), "the snapshot stopped"
            empty, topic, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                assert topic == b"" and payload == b""
                return meta, out
            assert int.from_bytes(seq, "big") == meta["seq"]
            out.append((topic, meta["seq"], payload))


class RouterIndex:
    """(topic, medium) -> block hash -> (parent hash, token ids, locality)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.blocks: dict[tuple[str, str], dict[int, Block]] = {}
        self.batches = 0
        self.heartbeats = 0

    def apply(self, frames: list[Frames]) -> RouterIndex:
        for topic, _, payload in frames:
            _, events, _ = msgpack.unpackb(payload, raw=False)
            self.batches += 1
            self.heartbeats += not events
            for event in events:
                self.event(topic.decode(), event)
        return self

    def event(self, topic: str, e: dict[str, Any]) -> None:
        kind = e["type"]
        if kind == "AllBlocksCleared":
            for place in [p for p in self.blocks if p[0] == topic]:
                del self.blocks[place]
            return
        place = self.blocks.setdefault((topic, e["medium"]), {})
        if kind == "BlockRemoved":
            for h in e["block_hashes"]:
                assert h in place, f"BlockRemoved of a block never stored in {topic} {e['medium']}"
                del place[h]
            return
        assert kind == "BlockStored", kind
        assert e["block_size"] == self.block_size
        hashes, ids, parent = e["block_hashes"], e["token_ids"], e["parent_block_hash"]
        assert len(ids) == len(hashes) * self.block_size
        for i, h in enumerate(hashes):
            assert h not in place, "a block stored twice without its removal"
            tokens = tuple(ids[i * self.block_size : (i + 1) * self.block_size])
            place[h] = (parent, tokens, e.get("locality", "LOCAL"))
            parent = h

    def state(self) -> dict[tuple[str, str], dict[int, Block]]:
        """The index without empty (topic, medium) entries."""
        return {place: blocks for place, blocks in self.blocks.items() if blocks}

    def prefix_tokens(self, topic: str, medium: str, last: int) -> int:
        """How many tokens the chain ending at block ``last`` covers (0: not held)."""
        place = self.blocks.get((topic, medium), {})
        n = 0
        while last in place:
            n += self.block_size
            parent = place[last][0]
            if parent is None:
                break
            last = parent
        return n
