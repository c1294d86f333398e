"""The router side of bench_events_snapshot.py: a router's restart from a snapshot, its
index built as the batches arrive (token ids kept as the bytes they came in), the first
router of the benchmark (every token id a Python int) for comparison, and NVIDIA
Dynamo's own indexer fed the same snapshot.

Primitives: :func:`router_restart` (-> :class:`Restart`), :func:`index_batch`,
:func:`index_decoded`, :func:`token_ids`, :func:`dynamo_index`.
"""

from __future__ import annotations

import sys
import time
from array import array
from pathlib import Path
from typing import Any, NamedTuple

END_SEQ = (-1).to_bytes(8, "big", signed=True)
BLOCK = 16


def router_restart(
    endpoint: str, received_event: Any = None, stream: bool = True, full_decode: bool = False
) -> Restart:
    """Ask for a snapshot and build the index as a router does: each batch indexed as it
    arrives (:func:`index_batch`, token ids kept packed); without ``stream``, every batch
    received first and then indexed (the daemon's part timed alone), and with
    ``full_decode`` also indexed again by a full msgpack decode (:func:`index_decoded`,
    token ids as Python ints: the router this benchmark had first)."""
    import msgpack
    import zmq

    index: Index = {}
    tokens: list[Any] = []
    frames = []
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(endpoint)
        t0 = time.perf_counter()
        sock.send_multipart([b"", b""])
        _, _, _, raw = sock.recv_multipart()
        meta = msgpack.unpackb(raw)
        while True:
            _, topic, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                break
            frames.append((topic, payload))
            if stream:
                index_batch(index, tokens, topic, payload)
        received = time.perf_counter() - t0  # streamed: each batch indexed before the next was read
        if received_event is not None:
            received_event.set()  # the daemon's part is over: stop the pinger
    built, decoded = received, None
    if full_decode:  # first: the other index's objects would slow its garbage collections
        t1 = time.perf_counter()
        old_index, old_tokens = index_decoded(frames)
        decoded = received + time.perf_counter() - t1
        del old_index
        old_tokens = old_tokens[:1000]
    if not stream:
        t1 = time.perf_counter()
        for topic, payload in frames:
            index_batch(index, tokens, topic, payload)
        built = received + time.perf_counter() - t1
    if full_decode:
        assert index == index_decoded(frames)[0], "the two routers built different indexes"
        assert [token_ids(t).tolist() for t in tokens[:1000]] == old_tokens
    nbytes = sum(len(payload) for _, payload in frames)
    blocks = sum(len(p) for p in index.values())
    return Restart(received, built, decoded, nbytes, meta["chunks"], blocks, len(tokens), frames)


class Restart(NamedTuple):
    received_s: float
    """From the request to the end marker."""
    built_s: float
    """From the request to a complete index (token ids kept packed)."""
    decoded_s: float | None
    """From the request to the index built by a full decode (every token id a Python int)."""
    nbytes: int
    chunks: int
    blocks: int
    events: int
    frames: list[tuple[bytes, bytes]]


Index = dict[tuple[bytes, str], dict[int, int | None]]
"""Per (topic, medium) each block's parent: what a router matches prompts against."""


def index_batch(index: Index, tokens: list[Any], topic: bytes, payload: bytes) -> None:
    """Add one snapshot batch to ``index``, and per event its token ids to ``tokens``,
    kept where they arrived (a view of the batch's bytes: 5 bytes an id, msgpack's
    ``uint 32`` tag and the id big-endian; :func:`token_ids` reads them), as a compiled
    router reads a batch, with no Python int per token id: the batch's ``token_ids``
    arrays are checked and cut out of its bytes, and the rest (block hashes, parent,
    medium) is decoded by msgpack.  A batch whose token ids have other integer widths is
    decoded whole (:func:`index_decoded`; neither reads the array form of
    ``events_encoding: array``, which this benchmark's daemon does not use)."""
    import msgpack

    try:
        events, ids = _cut_token_ids(msgpack, payload)
    except _OtherForm:
        decoded_index, decoded_tokens = index_decoded([(topic, payload)])
        for place, parents in decoded_index.items():
            index.setdefault(place, {}).update(parents)
        tokens.extend(array("I", t) for t in decoded_tokens)
        return
    for e in events:
        if e["type"] != "BlockStored":
            continue
        place = index.setdefault((topic, e["medium"]), {})
        hashes = e["block_hashes"]
        place.update(zip(hashes, [e["parent_block_hash"], *hashes[:-1]]))
    tokens.extend(ids)


def token_ids(items: memoryview | array[int]) -> array[int]:
    """The token ids :func:`index_batch` kept, as an array('I')."""
    if isinstance(items, array):
        return items
    n = len(items) // 5
    u32 = bytearray(4 * n)
    for i in range(4):  # big-endian items -> u32 in this host's order
        u32[i::4] = items[1 + i :: 5] if sys.byteorder == "big" else items[4 - i :: 5]
    return array("I", u32)


class _OtherForm(Exception):
    """A batch :func:`_cut_token_ids` does not read."""


_TOKEN_IDS = b"\xa9token_ids"  # the msgpack key
_U32_TAGS: dict[int, bytes] = {}
_PLACEHOLDERS = [bytes([i]) for i in range(128)]  # msgpack positive fixints


def _cut_token_ids(msgpack: Any, payload: bytes) -> tuple[list[dict[str, Any]], list[memoryview]]:
    """A ``KVEventBatch``'s events with each ``token_ids`` replaced by its index in the
    returned list of token id views.  Where the key is found inside other bytes (a hash, a
    token id), the decoded events do not hold the indexes in order: _OtherForm."""
    view = memoryview(payload)
    parts: list[Any] = []
    ids = []
    at = 0
    while (key := payload.find(_TOKEN_IDS, at)) >= 0:
        head = key + len(_TOKEN_IDS)
        tag = payload[head]
        if tag & 0xF0 == 0x90:
            n, body = tag & 0x0F, head + 1
        elif tag == 0xDC:
            n, body = int.from_bytes(payload[head + 1 : head + 3], "big"), head + 3
        elif tag == 0xDD:
            n, body = int.from_bytes(payload[head + 1 : head + 5], "big"), head + 5
        else:
            raise _OtherForm
        end = body + 5 * n
        tags = _U32_TAGS.get(n) or _U32_TAGS.setdefault(n, b"\xce" * n)
        if payload[body:end:5] != tags:
            raise _OtherForm
        i = len(ids)
        parts += (view[at:head], _PLACEHOLDERS[i] if i < 128 else msgpack.packb(i))
        ids.append(view[body:end])
        at = end
    parts.append(view[at:])
    try:
        batch = msgpack.unpackb(b"".join(parts))
        events = batch[1]
        if not all(isinstance(e, dict) for e in events):
            raise _OtherForm
        placed = [e["token_ids"] for e in events if "token_ids" in e]
    except (ValueError, TypeError, KeyError, IndexError, msgpack.UnpackException):
        raise _OtherForm from None
    if placed != list(range(len(ids))):
        raise _OtherForm
    return events, ids


def index_decoded(frames: list[tuple[bytes, bytes]]) -> tuple[Index, list[list[int]]]:
    """The same index from every batch decoded whole by msgpack: 25.6 M token ids become
    Python ints (a router written this way in Python; no compiled router does it)."""
    import msgpack

    index: Index = {}
    tokens: list[list[int]] = []
    for topic, payload in frames:
        for e in msgpack.unpackb(payload)[1]:
            if e["type"] != "BlockStored":
                continue
            place = index.setdefault((topic, e["medium"]), {})
            hashes = e["block_hashes"]
            place.update(zip(hashes, [e["parent_block_hash"], *hashes[:-1]]))
            tokens.append(e["token_ids"])
    return index, tokens


def dynamo_index(frames: list[tuple[bytes, bytes]], last_prompt: list[int], model: str, workdir: Path) -> None:
    """NVIDIA Dynamo's own indexer (``python -m dynamo.indexer`` from .venv-dynamo, Rust)
    rebuilding its index from the snapshot: it does not speak our snapshot request, so
    a relay here plays a worker whose replay endpoint holds the snapshot's batches
    (numbered 0..n-1) and whose live stream starts at n; Dynamo sees the gap and asks
    for it, as it does for a worker that registers after its traffic.  Printed: the
    time from its replay request to its ``/query`` answering the node's last prompt in
    full (polled every 10 ms; ``last_prompt``: the token ids of the snapshot's
    last chunks, of ``model``): its msgpack decoding, its ``tokens_hash`` per block
    and its radix tree, at compiled speed."""
    import msgpack
    import zmq

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.integrations.dynamo.indexer import DYNAMO_PYTHON, DynamoIndexer

    if not DYNAMO_PYTHON.exists():
        print(f"  Dynamo's indexer: not timed ({DYNAMO_PYTHON} missing: make setup-dynamo)")
        return
    live, replay = f"ipc://{workdir}/dynamo-live.sock", f"ipc://{workdir}/dynamo-replay.sock"
    empty = msgpack.packb([time.time(), [], 0])
    topic = frames[0][0]
    indexer = DynamoIndexer(DYNAMO_PYTHON, workdir)
    try:
        with zmq.Context() as ctx, ctx.socket(zmq.PUB) as pub, ctx.socket(zmq.ROUTER) as router:
            for sock in (pub, router):
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 0)
            pub.bind(live)
            router.bind(replay)
            indexer.register(7, live, model, BLOCK, replay_endpoint=replay)
            deadline = time.monotonic() + 30
            while not indexer.listening(7):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Dynamo's listener did not connect:\n{indexer.log()[-2000:]}")
                time.sleep(0.05)
            n = len(frames)
            while not router.poll(100):  # a live batch until Dynamo asks for the ones before it
                pub.send_multipart([topic, n.to_bytes(8, "big"), empty])
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Dynamo asked for no replay:\n{indexer.log()[-2000:]}")
            identity, _, start = router.recv_multipart()
            t0 = time.perf_counter()
            for seq in range(int.from_bytes(start, "big"), n):
                router.send_multipart([identity, b"", frames[seq][0], seq.to_bytes(8, "big"), frames[seq][1]])
            router.send_multipart([identity, b"", b"", END_SEQ, b""])
            sent = time.perf_counter() - t0
            want = len(last_prompt) // BLOCK * BLOCK
            while indexer.longest(model, last_prompt, 7) < want:
                if time.perf_counter() - t0 > 300:
                    raise RuntimeError(f"Dynamo's index incomplete after 300 s:\n{indexer.log()[-2000:]}")
                time.sleep(0.01)
            done = time.perf_counter() - t0
        print(
            f"  Dynamo's indexer (ai-dynamo-runtime, Rust) fed the snapshot: index complete {done:.3f} s after "
            f"its replay request (the {n} batches handed to ZeroMQ in {sent:.3f} s; asked from seq "
            f"{int.from_bytes(start, 'big')})"
        )
    finally:
        indexer.stop()
