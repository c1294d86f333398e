"""Feed decoded vLLM-format KV events to Dynamo's own radix tree (run with Dynamo's python).

stdin: JSON lines.  ``{"worker": int, "block_size": int, "events": [event...]}``
(events as vLLM's field names, decoded from msgpack by the caller) applies each
event to one ``dynamo._core.RadixTree`` as Dynamo's vLLM relay converts it
(ai-dynamo/dynamo ``lib/kv-router/src/zmq_wire.rs``: ``convert_event`` and
``create_stored_blocks``): ``BlockStored`` -> a stored event whose blocks keep
our ``block_hashes`` as external ids and get ``tokens_hash`` =
``compute_block_hash_for_seq(block's token ids, block_size)[0]`` (Dynamo's own
function, no LoRA, no multimodal info), ``parent_hash`` = ``parent_block_hash``;
a block whose token count is not the block size ends the event (as there);
``BlockRemoved`` -> removed ``block_hashes``; ``AllBlocksCleared`` -> cleared.
The tree has no tiers (the binding's tree is Dynamo's device tree), so
``medium`` is not used.  ``{"query": [token ids]}`` prints
``{"overlap": {worker: tokens}}`` from ``find_matches`` on the prompt's
``compute_block_hash_for_seq`` hashes (what Dynamo's ``/query`` does).
A stored event whose parent the tree does not hold is skipped, as Dynamo's
indexer skips it (the tree refuses it: "Failed to find parent block"); the
events batch prints ``{"skipped": [event index...]}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from dynamo._core import RadixTree, compute_block_hash_for_seq


def dynamo_event(event_id: int, event: dict[str, Any], block_size: int) -> dict[str, Any]:
    kind = event["type"]
    if kind == "BlockStored":
        tokens = event["token_ids"]
        blocks = []
        for i, block_hash in enumerate(event["block_hashes"]):
            chunk = tokens[i * event["block_size"] : (i + 1) * event["block_size"]]
            if event["block_size"] != block_size or len(chunk) != block_size:
                break
            blocks.append({"block_hash": block_hash, "tokens_hash": compute_block_hash_for_seq(chunk, block_size)[0]})
        data: Any = {"stored": {"parent_hash": event["parent_block_hash"], "blocks": blocks}}
    elif kind == "BlockRemoved":
        data = {"removed": {"block_hashes": event["block_hashes"]}}
    elif kind == "AllBlocksCleared":
        data = "cleared"
    else:
        raise ValueError(f"unknown event type {kind!r}")
    return {"event_id": event_id, "data": data, "dp_rank": 0}


def main() -> int:
    tree = RadixTree()
    block_size = 0
    event_id = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        message = json.loads(line)
        if "events" in message:
            block_size = message["block_size"]
            skipped = []
            for i, event in enumerate(message["events"]):
                try:
                    tree.apply_event(message["worker"], json.dumps(dynamo_event(event_id, event, block_size)).encode())
                except RuntimeError as err:
                    if "Failed to find parent block" not in str(err):
                        raise
                    skipped.append(i)
                event_id += 1
            print(json.dumps({"skipped": skipped}), flush=True)
        else:
            hashes = compute_block_hash_for_seq(message["query"], block_size)
            scores = tree.find_matches(hashes).scores
            overlap = {str(worker): blocks * block_size for (worker, _dp), blocks in scores.items()}
            print(json.dumps({"overlap": overlap}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
