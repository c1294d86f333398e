"""Decode KV-event messages with vLLM's own decoder (run with vLLM's python).

stdin: one JSON object per line, ``{"topic": hex, "seq": hex, "payload": hex}``
(the three frames of one PUB message).  stdout: one JSON object per message,
``{"topic": str, "seq": int, "ts": float, "data_parallel_rank": int | None,
"events": [{"type": class name, field: value, ...}]}``, decoded by
``msgspec.msgpack.Decoder(KVEventBatch)`` from ``vllm.distributed.kv_events``:
a payload vLLM cannot decode fails the run (exit code 1, the error on stderr).
"""

from __future__ import annotations

import json
import sys

import msgspec
from vllm.distributed.kv_events import KVEventBatch


def main() -> int:
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    for line in sys.stdin:
        if not line.strip():
            continue
        message = json.loads(line)
        batch = decoder.decode(bytes.fromhex(message["payload"]))
        events = [{"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in batch.events]
        out = {
            "topic": bytes.fromhex(message["topic"]).decode(),
            "seq": int.from_bytes(bytes.fromhex(message["seq"]), "big"),
            "ts": batch.ts,
            "data_parallel_rank": batch.data_parallel_rank,
            "events": events,
        }
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
