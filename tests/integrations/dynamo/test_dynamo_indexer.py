"""The daemon's KV-event stream read by NVIDIA Dynamo's own KV indexer (docs/events.md, "Dynamo").

Real components end to end: the daemon with events on, the real client putting
chunks with their token ids, and Dynamo's standalone indexer from its PyPI
wheel (``python -m dynamo.indexer`` in ``.venv-dynamo``; tests/integrations/dynamo/indexer.py)
subscribed to the daemon with its own ZeroMQ listener, its own vLLM-event
conversion (lib/kv-router/src/zmq_wire.rs ``convert_event``: one ``tokens_hash``
per block from ``token_ids``, our hashes as external ids) and its own radix tree.
After every step, Dynamo's ``POST /query`` overlap for a prompt, rounded down to
whole chunks, must equal the daemon's own ``lookup`` and its ``POST /query``:

- stores (shared leading blocks announced once), a delete inside a prompt, LRU
  eviction without a disk, a spill to disk, ``clear`` (``AllBlocksCleared``);
- a router that registers after the traffic rebuilds the same index from the
  daemon's replay endpoint (Dynamo asks for the gap itself);
- Dynamo's radix tree fed only our snapshot answers as the live-fed indexer
  (radix_harness.py, the relay's conversion applied to the snapshot's events);
- after a daemon restart Dynamo keeps the old epoch's blocks until the worker is
  registered again (its listener has no epoch);
- where Dynamo files our blocks: ``medium`` -> its storage tier
  (``StorageTier::from_kv_medium`` in lib/kv-router/src/protocols.rs).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from lmcache_client import CacheClient
from lmcache_client.keys import chunk_keys, chunk_tokens
from lmcache_client.protocol import PutStatus
from lmcache_server.events.announcer import MEDIUM

from ...conftest import Daemon, free_port, wait_for
from ...events.test_events_query import post
from ...server.events_router import snapshot
from .indexer import ROOT, DynamoIndexer

MODEL = "test/dynamo-model"
NS = f"{MODEL}|bfloat16|L1|KV1|D64|tp0of1|c256"
CHUNK = 256
BLOCK = 16

# Where Dynamo's indexer files a block by its ``medium`` (ai-dynamo-runtime 1.6.1:
# ``StorageTier::from_kv_medium``, ai-dynamo/dynamo lib/kv-router/src/protocols.rs; a
# medium it does not know is filed as GPU), as the tiers of its ``/query`` answer.
DYNAMO_TIER = {"GPU": "gpu", "CPU": "cpu", "STORAGE": "disk", "DISK": "disk"}


def events_daemon(factory: Callable[..., Daemon], **config: Any) -> Daemon:
    settings: dict[str, Any] = {
        "events_endpoint": f"tcp://127.0.0.1:{free_port()}",
        "events_replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
        "events_node": "node-a",
        "events_block_size": BLOCK,
        "events_batch_interval_s": 0.005,
        "cache_policy": "lru",
        **config,
    }
    daemon = factory(**settings)
    daemon.events = settings["events_endpoint"]  # type: ignore[attr-defined]
    daemon.replay = settings["events_replay_endpoint"]  # type: ignore[attr-defined]
    return daemon


def prompt(seed: int, n_tokens: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(n_tokens)]


def put(c: CacheClient, tokens: list[int], size: int = 4096) -> list[bytes]:
    keys = chunk_keys(tokens, CHUNK)
    statuses = c.put(keys, [os.urandom(size) for _ in keys], tokens=chunk_tokens(tokens, CHUNK))
    assert set(statuses) <= {PutStatus.STORED, PutStatus.EXISTS}
    return keys


def node_query(daemon: Daemon, tokens: list[int]) -> dict[str, Any]:
    """The daemon's own ``POST /query`` answer for ``tokens`` (docs/events.md, "Query")."""
    status, answer = post(daemon, {"tokens": tokens, "namespace": NS})
    if status == 404:  # nothing of this namespace on the node (after a clear)
        return {"prefix_tokens": 0, "by_medium": {}}
    assert status == 200, answer
    return dict(answer["best"])


def agree(
    indexer: DynamoIndexer, daemon: Daemon, c: CacheClient, tokens: list[int], instance: int = 1
) -> tuple[int, int]:
    """Wait until Dynamo's overlap for ``tokens``, rounded down to whole chunks, equals the
    daemon's ``lookup`` and its ``POST /query`` (Dynamo counts blocks, the daemon serves
    chunks); ``(daemon's, Dynamo's)``."""
    seen: dict[str, int] = {}

    def same() -> bool:
        seen["daemon"] = c.lookup_tokens(tokens)
        seen["query"] = node_query(daemon, tokens)["prefix_tokens"]
        seen["dynamo"] = indexer.longest(MODEL, tokens, instance)
        return seen["daemon"] == seen["query"] == seen["dynamo"] // CHUNK * CHUNK

    try:
        wait_for(same, timeout_s=10)
    except AssertionError:
        raise AssertionError(f"Dynamo and the daemon disagree: {seen}\n{indexer.log()[-3000:]}") from None
    return seen["daemon"], seen["dynamo"]


def register(indexer: DynamoIndexer, daemon: Daemon, instance: int) -> None:
    indexer.register(instance, daemon.events, MODEL, BLOCK, replay_endpoint=daemon.replay)  # type: ignore[attr-defined]
    wait_for(lambda: indexer.listening(instance))


def test_dynamo_indexer_follows_stores_deletes_evictions_and_clears(
    daemon_factory: Callable[..., Daemon], dynamo_indexer: DynamoIndexer
) -> None:
    daemon = events_daemon(daemon_factory, max_local_cpu_size="4MiB")
    register(dynamo_indexer, daemon, 1)
    a = prompt(1, 3 * CHUNK)
    b = a[: CHUNK + 32] + prompt(2, CHUNK - 32)  # shares A's first chunk and 2 blocks of its second
    whole = {"a": (3 * CHUNK, 3 * CHUNK), "b": (2 * CHUNK, 2 * CHUNK), "none": (0, 0)}
    with daemon.client(namespace=NS, chunk_size=CHUNK) as c:
        keys_a = put(c, a)
        put(c, b)
        assert agree(dynamo_indexer, daemon, c, a) == whole["a"]
        assert agree(dynamo_indexer, daemon, c, b) == whole["b"]
        assert agree(dynamo_indexer, daemon, c, a + prompt(3, 100)) == whole["a"]  # a partial chunk is never cached
        # Dynamo counts blocks, the daemon chunks: a prompt that leaves A after 288 tokens.
        assert agree(dynamo_indexer, daemon, c, a[: CHUNK + 32] + prompt(4, CHUNK - 32)) == (CHUNK, CHUNK + 32)
        # Memory chunks are announced with medium CPU: Dynamo files them in its host tier.
        summary = dynamo_indexer.overlap(MODEL, a)[1]
        tier = DYNAMO_TIER.get(MEDIUM["memory"], "gpu")
        assert summary[tier] == 3 * CHUNK and summary["gpu"] == (3 * CHUNK if tier == "gpu" else 0), summary
        assert node_query(daemon, a)["by_medium"] == {MEDIUM["memory"]: 3 * CHUNK}

        assert c.delete(keys_a[1:2]) == [True]  # inside A: its third chunk is no prefix any more
        # ... but the 2 blocks B shares with A stay announced: B holds them.
        assert agree(dynamo_indexer, daemon, c, a) == (CHUNK, CHUNK + 32)
        assert agree(dynamo_indexer, daemon, c, b) == whole["b"]

        # Without a disk, chunks evicted from memory leave the node (LRU: A and B go first).
        for _ in range(8):
            assert c.put([os.urandom(32)], [os.urandom(1 << 20)]) == [PutStatus.STORED]
        wait_for(lambda: c.lookup_tokens(a) == 0 and c.lookup_tokens(b) == 0)
        assert agree(dynamo_indexer, daemon, c, a) == whole["none"]
        assert agree(dynamo_indexer, daemon, c, b) == whole["none"]

        put(c, a)
        assert agree(dynamo_indexer, daemon, c, a) == whole["a"]
        # A router that starts now: Dynamo sees the sequence start past 0 and replays the rest.
        register(dynamo_indexer, daemon, 2)
        put(c, prompt(5, CHUNK))  # a live batch, so that the new listener sees the gap
        assert agree(dynamo_indexer, daemon, c, a, instance=2) == whole["a"]
        assert agree(dynamo_indexer, daemon, c, b, instance=2) == (CHUNK, CHUNK + 32)  # B starts like A

        assert c.clear() > 0  # AllBlocksCleared
        for instance in (1, 2):
            assert agree(dynamo_indexer, daemon, c, a, instance) == whole["none"]
            assert agree(dynamo_indexer, daemon, c, prompt(5, CHUNK), instance) == whole["none"]


def test_dynamo_indexer_still_sees_a_prefix_spilled_to_disk(
    daemon_factory: Callable[..., Daemon], dynamo_indexer: DynamoIndexer, tmp_path: Path
) -> None:
    daemon = events_daemon(
        daemon_factory,
        local_disk=f"file://{tmp_path / 'spill'}",
        max_local_cpu_size="8MiB",
        max_local_disk_size="64MiB",
        spill_ahead_size=0,
    )
    register(dynamo_indexer, daemon, 3)
    a = prompt(6, 2 * CHUNK)
    with daemon.client(namespace=NS, chunk_size=CHUNK) as c:
        keys = put(c, a, size=1 << 20)
        assert agree(dynamo_indexer, daemon, c, a, instance=3) == (2 * CHUNK, 2 * CHUNK)
        for _ in range(12):  # token-less fillers push A out of memory onto the disk
            assert c.put([os.urandom(32)], [os.urandom(1 << 20)]) == [PutStatus.STORED]
        wait_for(lambda: c.lookup(keys).tiers == ["disk", "disk"])
        assert agree(dynamo_indexer, daemon, c, a, instance=3) == (2 * CHUNK, 2 * CHUNK)
        # Where Dynamo files a block on our disk: by the medium the daemon announces.
        summary = dynamo_indexer.overlap(MODEL, a)[3]
        tier = DYNAMO_TIER.get(MEDIUM["disk"], "gpu")
        assert summary[tier] == 2 * CHUNK, (MEDIUM["disk"], summary)
        assert summary["gpu"] == summary["cpu"] == 0, summary  # and no longer in memory
        assert node_query(daemon, a)["by_medium"] == {MEDIUM["disk"]: 2 * CHUNK}
        assert c.delete(keys[:1]) == [True]
        assert agree(dynamo_indexer, daemon, c, a, instance=3) == (0, 0)


def test_after_a_daemon_restart_dynamo_drops_the_old_epoch_by_itself(
    daemon_factory: Callable[..., Daemon], dynamo_indexer: DynamoIndexer
) -> None:
    """A restart is a new epoch: ``AllBlocksCleared`` first, numbered past every batch of
    the old epoch (an epoch's first sequence number is its start time in microseconds).
    Dynamo's listener has no epoch; it takes the new epoch's batches as the next ones
    (a gap, which it asks the replay endpoint about), applies the clear and drops the old
    epoch's blocks without the worker being registered again.  (With sequences from 0 at
    every start, as vLLM numbers them, it took them for batches it already had and kept
    the old blocks until re-registered.)"""
    daemon = events_daemon(daemon_factory)
    register(dynamo_indexer, daemon, 4)
    a, b = prompt(7, 2 * CHUNK), prompt(8, CHUNK)
    with daemon.client(namespace=NS, chunk_size=CHUNK) as c:
        put(c, a)
        assert agree(dynamo_indexer, daemon, c, a, instance=4) == (2 * CHUNK, 2 * CHUNK)
        before = int(c.stats()["events"]["next_seq"])
    assert daemon.stop() == 0
    daemon.start()
    with daemon.client(namespace=NS, chunk_size=CHUNK) as c:
        assert int(c.stats()["events"]["next_seq"]) > before, "the new epoch numbers past the old one"
        put(c, b)
        wait_for(lambda: dynamo_indexer.longest(MODEL, b, 4) == CHUNK)
        assert agree(dynamo_indexer, daemon, c, a, instance=4) == (0, 0), "the old epoch's blocks are gone"
        assert agree(dynamo_indexer, daemon, c, b, instance=4) == (CHUNK, CHUNK)


def radix_overlaps(
    python: Path, worker: int, events: list[dict[str, Any]], prompts: list[list[int]]
) -> tuple[list[int], list[int]]:
    """Dynamo's own radix tree (radix_harness.py, in Dynamo's venv) fed ``events``: the
    indexes of the events it skipped (no parent), and each prompt's overlap for ``worker``."""
    lines = [json.dumps({"worker": worker, "block_size": BLOCK, "events": events})]
    lines += [json.dumps({"query": p}) for p in prompts]
    run = subprocess.run(
        [str(python), "-m", "tests.integrations.dynamo.radix_harness"],
        input="\n".join(lines) + "\n",
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = [json.loads(line) for line in run.stdout.splitlines()]
    return out[0]["skipped"], [int(a["overlap"].get(str(worker), 0)) for a in out[1:]]


def test_dynamos_tree_rebuilt_from_our_snapshot_equals_the_one_its_indexer_built_live(
    daemon_factory: Callable[..., Daemon], dynamo_indexer: DynamoIndexer, dynamo_python: Path
) -> None:
    """A router that starts late bootstraps from the snapshot (docs/events.md, "Snapshot")
    instead of the whole stream: Dynamo's radix tree fed only the snapshot's batches answers
    every prompt as Dynamo's indexer that followed the live stream from the start."""
    daemon = events_daemon(
        daemon_factory, max_local_cpu_size="4MiB", events_snapshot_endpoint=f"tcp://127.0.0.1:{free_port()}"
    )
    register(dynamo_indexer, daemon, 5)
    a = prompt(10, 3 * CHUNK)
    b = a[: CHUNK + 32] + prompt(11, 2 * CHUNK - 32)
    c_ = prompt(12, 2 * CHUNK)
    prompts = [a, b, c_, a[: CHUNK + 48] + prompt(13, CHUNK)]
    with daemon.client(namespace=NS, chunk_size=CHUNK) as c:
        keys_a = put(c, a)
        put(c, b)
        put(c, c_)
        assert c.delete(keys_a[1:2]) == [True]
        live = [agree(dynamo_indexer, daemon, c, p, instance=5)[1] for p in prompts]
        meta, frames = snapshot(daemon.config["events_snapshot_endpoint"])
    assert live == [CHUNK + 32, 3 * CHUNK, 2 * CHUNK, CHUNK + 32]  # Dynamo counts blocks
    assert meta["chunks"] > 0
    events = [e for _, _, payload in frames for e in msgpack.unpackb(payload, raw=False)[1]]
    assert {e["type"] for e in events} == {"BlockStored"}
    skipped, overlaps = radix_overlaps(dynamo_python, 5, events, prompts)
    assert overlaps == live
    # Dynamo skips only chunks whose parent left the node (A's third chunk: its second was
    # deleted; no prompt reaches it), never one whose parent comes later in the snapshot.
    held = {h for e in events for h in e["block_hashes"]}
    assert skipped == [i for i, e in enumerate(events) if e["parent_block_hash"] not in held | {None}]
    assert len(skipped) == 1
