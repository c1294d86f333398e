"""The daemon's KV-event stream against what llm-d and Mooncake Conductor parse (encoding tests).

Neither runs here (both are Go/C++ services with no wheel); these tests read the
real daemon's stream (put, a shared prefix, a delete, a spill to disk, clear;
captured through the replay endpoint) and check it against the rules in their
published source, read (no code taken) at:

- llm-d: github.com/llm-d/llm-d-kv-cache @ 7be76e1 (2026-06-12):
  ``pkg/kvevents/engineadapter/common.go`` (``parseTopic``: ``kv@<pod>@<model>``,
  split on ``@`` into exactly 3 parts), ``pkg/kvevents/engineadapter/vllm_adapter.go``
  (each event decoded as a positional msgpack array, tag first: vLLM's
  ``array_like=True`` layout), ``pkg/kvevents/pool.go`` (``BlockStored``: the
  parent's *engine* key must already map to a *request* key, else the event is
  dropped; request keys are recomputed from ``token_ids`` in blocks of the
  indexer's ``blockSizeTokens``; ``BlockRemoved`` evicts by engine key and
  ``lower(medium)`` tier; ``AllBlocksCleared`` drops the pod),
  ``pkg/kvcache/kvblock/token_processor.go`` (request key = FNV-64a of canonical
  CBOR ``[parent, tokens, extra]``, root = that hash of ``[FNV-64a(hashSeed), nil,
  model]``), ``pkg/kvcache/backend.go`` (default tier weights ``gpu`` 1.0, ``cpu`` 0.8).
- Mooncake Conductor: github.com/kvcache-ai/Mooncake ``mooncake-conductor/``:
  ``src/zmq/msg_decoder.cpp`` (vLLM batches: every event must be an array, else
  the whole batch is rejected), ``src/kvevent/event_handler.cpp`` (a vLLM
  publisher's events are indexed only for medium ``gpu``; other media are
  no-ops; the shared tiers it knows are ``cpu``, ``cpu_pinned``, ``disk``; it
  indexes the event's ``block_hashes`` and computes vLLM's own hashes for a
  query), ``docs/source/design/conductor/indexer-api-design.md`` (media ``gpu``,
  ``cpu``, ``disk``; RFC #1527 events for other publishers).

What holds and what does not is stated per test; docs/events.md ("Mapping to
routers") says the same for operators.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from lmcache_client.keys import chunk_keys, chunk_tokens
from lmcache_client.protocol import PutStatus
from lmcache_server.events.announcer import MEDIUM

from ...conftest import Daemon, wait_for
from ...events.test_events import events_daemon, quiet, replay

MODEL = "test/router-model"
NS = f"{MODEL}|bfloat16|L1|KV1|D64|tp0of1|c256"
CHUNK = 256
BLOCK = 16
NODE = "pod-a"


def prompt(seed: int, n_tokens: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(n_tokens)]


A = prompt(1, 3 * CHUNK)
B = A[: CHUNK + 32] + prompt(2, CHUNK - 32)  # A's first chunk and 2 more blocks, then its own


def scenario(factory: Callable[..., Daemon], root: Any, **config: Any) -> dict[str, Any]:
    """The whole stream of one scenario, raw and decoded, and the daemon's lookups at its end."""
    daemon = events_daemon(
        factory,
        node=NODE,
        local_disk=f"file://{root}",
        max_local_cpu_size="8MiB",
        max_local_disk_size="64MiB",
        spill_ahead_size=0,
        **config,
    )
    with daemon.client(namespace=NS, chunk_size=CHUNK) as c:
        keys_a = chunk_keys(A, CHUNK)
        for tokens in (A, B):
            keys = chunk_keys(tokens, CHUNK)
            assert set(c.put(keys, [os.urandom(1 << 20) for _ in keys], tokens=chunk_tokens(tokens, CHUNK))) <= {
                PutStatus.STORED,
                PutStatus.EXISTS,
            }
        assert c.delete(keys_a[2:]) == [True]  # A's last chunk leaves the node
        for _ in range(12):  # token-less fillers push A and B to the disk (a medium change)
            assert c.put([os.urandom(32)], [os.urandom(1 << 20)]) == [PutStatus.STORED]
        wait_for(lambda: set(c.lookup(keys_a[:2]).tiers) == {"disk"})
        lookups = {"A": c.lookup_tokens(A), "B": c.lookup_tokens(B)}
        quiet(c)
        frames = replay(daemon)
    batches = [(topic.decode(), msgpack.unpackb(payload, raw=False)) for topic, _, payload in frames]
    return {"frames": frames, "batches": batches, "lookups": lookups}


@pytest.fixture(scope="module")
def stream(module_daemon_factory: Callable[..., Daemon], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return scenario(module_daemon_factory, tmp_path_factory.mktemp("spill"))


def events(stream: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(topic, e) for topic, (_, evs, _) in stream["batches"] for e in evs]


# -- the encoding: vLLM 0.32's maps by default, positional arrays for llm-d ---------------
def test_events_are_vllm_0_32_maps_by_default(stream: dict[str, Any]) -> None:
    """vLLM 0.32 encodes each event as a map tagged ``type`` (``KVCacheEvent`` without
    ``array_like``), and so does the daemon by default; llm-d's vLLM adapter and
    Conductor's vLLM decoder read only the earlier positional form and reject a map
    (``events_encoding: array`` is for them, next test)."""
    seen = 0
    for _, _, payload in stream["frames"]:
        batch = msgpack.unpackb(payload, raw=False)
        assert isinstance(batch, list) and len(batch) == 3  # [ts, events, dp_rank]: read by both
        for event in batch[1]:
            assert isinstance(event, dict) and "type" in event
            seen += 1
    assert seen >= 6


def llmd_decode(event: Any) -> dict[str, Any]:
    """An event as llm-d's vLLM adapter reads it (``vllm_adapter.go``: a positional array,
    tag first; BlockStored ``[tag, block_hashes, parent, token_ids, block_size, lora_id,
    medium, lora_name]``, BlockRemoved ``[tag, block_hashes, medium]``)."""
    assert isinstance(event, list) and event and isinstance(event[0], str), "llm-d: failed to decode tagged union"
    tag = event[0]
    if tag == "BlockStored":
        hashes, parent, tokens, block_size, lora_id, medium, lora_name = event[1:8]
        return {"type": tag, "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
                "block_size": block_size, "lora_id": lora_id, "medium": medium, "lora_name": lora_name}  # fmt: skip
    if tag == "BlockRemoved":
        return {"type": tag, "block_hashes": event[1], "medium": event[2]}
    assert tag == "AllBlocksCleared", f"llm-d: unknown vLLM event tag: {tag}"
    return {"type": tag}


def test_events_encoding_array_gives_llmd_the_same_events_as_positional_arrays(
    module_daemon_factory: Callable[..., Daemon], tmp_path_factory: pytest.TempPathFactory, stream: dict[str, Any]
) -> None:
    """The same scenario with ``events_encoding: array``: every event is an array llm-d
    decodes, and what it reads equals the map stream's event, field for field (but
    ``locality``, which the array form has no place for)."""
    arrays = scenario(module_daemon_factory, tmp_path_factory.mktemp("spill-array"), events_encoding="array")
    assert arrays["lookups"] == stream["lookups"]
    read = [(topic, llmd_decode(e)) for topic, (_, evs, _) in arrays["batches"] for e in evs]
    expected = [(topic, {k: v for k, v in e.items() if k != "locality"}) for topic, e in events(stream)]
    assert read == expected
    assert {e["type"] for _, e in read} == {"AllBlocksCleared", "BlockStored", "BlockRemoved"}
    assert {e.get("medium") for _, e in read} >= {"CPU", "STORAGE"}


# -- llm-d -----------------------------------------------------------------------------------
def test_topics_split_into_the_pod_and_model_llmd_reads(stream: dict[str, Any]) -> None:
    topics = {topic for topic, _ in stream["batches"]}
    assert f"kv@{NODE}@{MODEL}" in topics
    for topic in topics:
        parts = topic.split("@")  # llm-d's parseTopic: exactly 3 parts, else the whole topic is the pod
        assert len(parts) == 3 and parts[0] == "kv" and parts[1] == NODE, topic
        assert parts[2] in {MODEL, ""}  # "": the cold start's clear of the node's bare topic


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for extra, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * width):
            return bytes([major << 5 | extra]) + n.to_bytes(width, "big")
    raise ValueError(n)


def _cbor(value: object) -> bytes:
    """Canonical CBOR of the shapes llm-d hashes: unsigned ints, lists of them, a string, nil."""
    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        return _cbor_head(0, value)
    if isinstance(value, str):
        raw = value.encode()
        return _cbor_head(3, len(raw)) + raw
    assert isinstance(value, list)
    return _cbor_head(4, len(value)) + b"".join(_cbor(v) for v in value)


def _fnv64a(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def llmd_keys(parent: int | None, tokens: list[int], model: str = MODEL, seed: str = "") -> list[int]:
    """llm-d's request keys (TokensToKVBlockKeys) of the whole blocks of ``tokens``."""
    h = parent if parent is not None else _fnv64a(_cbor([_fnv64a(seed.encode()), None, model]))
    keys = []
    for i in range(0, len(tokens) - BLOCK + 1, BLOCK):
        h = _fnv64a(_cbor([h, tokens[i : i + BLOCK], None]))
        keys.append(h)
    return keys


def test_llmd_rebuilds_its_request_keys_from_our_token_ids_and_parent_chain(stream: dict[str, Any]) -> None:
    """pool.go's index, run over the stream: every ``BlockStored`` finds its parent (else llm-d
    drops it), every removal names a known block, and a prompt's longest run of request keys
    on the pod equals the daemon's lookup (rounded down to whole chunks: llm-d counts blocks)."""
    request_of: dict[int, int] = {}  # engine key (our block hash) -> llm-d request key
    tiers: dict[int, set[str]] = {}  # request key -> tiers holding it on this pod
    dropped, unknown_removals = [], []
    for topic, event in events(stream):
        if topic.split("@")[2] != MODEL:
            continue
        if event["type"] == "BlockStored":
            parent = event["parent_block_hash"]
            if parent is not None and parent not in request_of:
                dropped.append(event)
                continue
            assert len(event["token_ids"]) == len(event["block_hashes"]) * BLOCK  # whole blocks only
            keys = llmd_keys(request_of.get(parent) if parent is not None else None, event["token_ids"])
            assert len(keys) == len(event["block_hashes"])  # 1:1 engine -> request keys
            for engine, request in zip(event["block_hashes"], keys, strict=True):
                request_of[engine] = request
                tiers.setdefault(request, set()).add(event["medium"].lower())
        elif event["type"] == "BlockRemoved":
            for engine in event["block_hashes"]:
                if engine not in request_of:
                    unknown_removals.append(engine)
                else:
                    tiers.get(request_of[engine], set()).discard(event["medium"].lower())
        else:
            tiers.clear()
    assert dropped == [] and unknown_removals == []
    for name, tokens in (("A", A), ("B", B)):
        run = 0
        for key in llmd_keys(None, tokens):
            if not tiers.get(key):
                break
            run += 1
        assert run * BLOCK // CHUNK * CHUNK == stream["lookups"][name], (name, run)
    assert stream["lookups"] == {"A": 2 * CHUNK, "B": 2 * CHUNK}
    # Where the blocks are now: only on the disk, under our medium's lower-case name.
    assert {t for key in llmd_keys(None, A[: 2 * CHUNK]) for t in tiers[key]} == {MEDIUM["disk"].lower()}


# -- where each router files each medium we announce ----------------------------------------
LLMD_DEFAULT_TIER_WEIGHTS = {"gpu": 1.0, "cpu": 0.8}  # pkg/kvcache/backend.go
CONDUCTOR_VLLM_INDEXED_MEDIA = {"gpu"}  # event_handler.cpp HandleVllmStored / HandleVllmRemoved
CONDUCTOR_SHARED_TIERS = {"cpu", "cpu_pinned", "disk"}  # event_handler.cpp SharedTier (Mooncake publishers)


def test_how_llmd_and_conductor_file_the_media_we_announce(stream: dict[str, Any]) -> None:
    """Memory (``CPU``) is llm-d's ``cpu`` tier (weight 0.8 of a GPU hit); our disk medium
    ``STORAGE`` (vLLM's name) is a tier llm-d keeps but gives no default weight, and a name
    neither Conductor table knows (it says ``disk``). Conductor's vLLM adapter indexes ``gpu``
    events only: every event of ours is a no-op there, so Conductor cannot use this stream;
    it can ask the daemon's ``POST /query`` instead (docs/events.md, "Conductor")."""
    media = {e["medium"] for _, e in events(stream) if "medium" in e}
    assert media == set(MEDIUM.values()) == {"CPU", "STORAGE"}
    assert MEDIUM["memory"].lower() in LLMD_DEFAULT_TIER_WEIGHTS
    assert MEDIUM["disk"].lower() not in LLMD_DEFAULT_TIER_WEIGHTS
    assert not {m.lower() for m in media} & CONDUCTOR_VLLM_INDEXED_MEDIA
    assert MEDIUM["memory"].lower() in CONDUCTOR_SHARED_TIERS
    assert MEDIUM["disk"].lower() not in CONDUCTOR_SHARED_TIERS


def test_our_block_hashes_are_not_vllms_so_hash_matching_routers_need_token_ids(stream: dict[str, Any]) -> None:
    """Conductor (vLLM publishers) and llm-d's engine keys take ``block_hashes`` as vLLM's own;
    ours are the daemon's chain (docs/events.md, "Which hash"). llm-d recomputes request keys
    from ``token_ids`` (above) and so matches; Conductor's vLLM path matches ``block_hashes``
    against vLLM's SHA-256 chain of the query and so cannot. Every stored event carries its
    token ids for that reason."""
    stored = [e for _, e in events(stream) if e["type"] == "BlockStored"]
    assert stored and all(e["token_ids"] and e["block_size"] == BLOCK for e in stored)
    assert all(0 <= h < 1 << 63 for e in stored for h in e["block_hashes"])  # int64 and uint64 readers
    assert all(e.get("lora_name") is None and e.get("lora_id") is None for e in stored)


def test_llmd_request_keys_chain_through_the_parent_and_depend_on_model_and_seed() -> None:
    """The key function the llm-d test above uses: an event's keys chained from its parent's
    request key equal one pass over the whole prefix (what llm-d computes for a prompt)."""
    first = llmd_keys(None, A[:BLOCK])
    second = llmd_keys(first[-1], A[BLOCK : 2 * BLOCK])
    assert llmd_keys(None, A[: 2 * BLOCK]) == first + second  # chaining = one pass over the prefix
    assert llmd_keys(None, A[:BLOCK], model="other") != first  # the model is in the root
    assert llmd_keys(None, A[:BLOCK], seed="42") != first  # and so is hashSeed
