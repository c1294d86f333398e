"""KV events (docs/events.md): the real daemon's stream, read by real ZeroMQ
subscribers and decoded by vLLM's own ``KVEventBatch`` decoder.

- every batch vLLM 0.32's msgspec decoder reads (tests/integrations/vllm/vllm_harness/decode_events.py,
  run with vLLM's python), topics ``kv@<node>@<model>``;
- a late subscriber gets every batch from the replay endpoint, gap-free;
- put -> spill -> delete -> corrupt file -> clear gives exactly the expected
  events, hashes recomputed here from the token ids by the documented formula
  and equal on two daemons (replicas) for the same prefix;
- eviction without a disk removes; shared leading blocks are announced once;
- bad token ids get BAD_REQUEST and store nothing; a stalled subscriber never
  holds up a put, loses batches past its high-water mark and replays them.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from lmcache_client import CacheClient
from lmcache_client.errors import ServerError
from lmcache_client.keys import ROOT_KEY, ChunkTokens, chunk_keys, chunk_tokens
from lmcache_client.protocol import ErrorCode, PutStatus
from lmcache_server.config import ConfigError, load_config
from lmcache_server.storage.base import ChunkKey
from lmcache_server.storage.disk.files import path_for

from ..conftest import Daemon, free_port, wait_for
from ..integrations.vllm.vllm_harness.fixtures import ROOT, vllm_python  # noqa: F401 - a fixture

MODEL = "test/events-model"
NS = f"{MODEL}|bfloat16|L1|KV1|D64|tp0of1|c256"
CHUNK = 256
BLOCK = 16
END_SEQ = (-1).to_bytes(8, "big", signed=True)

Frames = tuple[bytes, int, bytes]  # topic, seq, payload


# -- helpers -------------------------------------------------------------------------
def events_daemon(factory: Callable[..., Daemon], node: str = "node-a", **config: Any) -> Daemon:
    settings: dict[str, Any] = {
        "events_endpoint": f"tcp://127.0.0.1:{free_port()}",
        "events_replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
        "events_node": node,
        "events_batch_interval_s": 0.005,
        "events_heartbeat_s": 0,
        "cache_policy": "lru",
        **config,
    }
    daemon = factory(**settings)
    daemon.events = settings["events_endpoint"]  # type: ignore[attr-defined]
    daemon.replay = settings["events_replay_endpoint"]  # type: ignore[attr-defined]
    return daemon


def next_seq(client: CacheClient) -> int:
    return int(client.stats()["events"]["next_seq"])


def quiet(client: CacheClient, **at_least: int) -> dict[str, Any]:
    """Wait until each events counter is at least its value and nothing waits for a batch."""

    def reached() -> dict[str, Any] | None:
        s: dict[str, Any] = client.stats()["events"]
        done = s["pending_events"] == 0 and all(s[k] >= v for k, v in at_least.items())
        return s if done else None

    return wait_for(reached)  # type: ignore[no-any-return]


def replay(daemon: Daemon, start: int = 0) -> list[Frames]:
    """Every batch the replay endpoint still holds from ``start`` on (a DEALER, as vLLM's protocol has it)."""
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(daemon.replay)  # type: ignore[attr-defined]
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(10_000), "the replay endpoint did not answer"
            empty, topic, seq, payload = sock.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert topic == b"" and payload == b""
                return out
            out.append((topic, int.from_bytes(seq, "big"), payload))


def all_batches(daemon: Daemon, client: CacheClient, **at_least: int) -> list[Frames]:
    """The whole stream after the epoch's start batch, by replay, once the counters
    reached ``at_least`` (see quiet)."""
    quiet(client, **at_least)
    frames = replay(daemon)
    first = int(client.stats()["events"]["first_seq"])
    assert [seq for _, seq, _ in frames] == list(range(first, first + len(frames))), "the sequence has gaps"
    # A cold start: its first batch clears the node's bare topic (no namespace was known).
    assert decode(frames[:1])[0]["events"] == [{"type": "AllBlocksCleared"}]
    assert frames[0][0].endswith(b"@")
    return frames[1:]


def decode(frames: list[Frames]) -> list[dict[str, Any]]:
    """Batches decoded with msgpack in this process (the shape; vLLM's decoder is used below)."""
    out = []
    for topic, seq, payload in frames:
        ts, events, rank = msgpack.unpackb(payload, raw=False)
        out.append({"topic": topic.decode(), "seq": seq, "ts": ts, "data_parallel_rank": rank, "events": events})
    return out


def decode_with_vllm(python: Path, frames: list[Frames]) -> list[dict[str, Any]]:
    lines = "".join(
        json.dumps({"topic": t.hex(), "seq": s.to_bytes(8, "big").hex(), "payload": p.hex()}) + "\n"
        for t, s, p in frames
    )
    run = subprocess.run(
        [str(python), "-m", "tests.integrations.vllm.vllm_harness.decode_events"],
        input=lines,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def events_of(batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for b in batches for e in b["events"]]


def h63(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def expected_hashes(key: bytes, parent: bytes, tokens: list[int]) -> list[int]:
    """docs/events.md, "Hashes", written out again from the doc."""
    n = len(tokens) // BLOCK
    out = []
    for j in range(n - 1):
        prefix = struct.pack(f"<{(j + 1) * BLOCK}I", *tokens[: (j + 1) * BLOCK])
        out.append(h63(hashlib.sha256(b"lmcache-event-block-v1" + parent + prefix).digest()))
    return [*out, h63(key)]


def prompt(seed: int, n_chunks: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(n_chunks * CHUNK)]


def chunk(tokens: list[int], i: int) -> list[int]:
    return tokens[i * CHUNK : (i + 1) * CHUNK]


@pytest.fixture
def tap() -> Iterator[Callable[[str], zmq.Socket[bytes]]]:
    """``tap(endpoint)``: a SUB socket subscribed to everything."""
    ctx = zmq.Context()
    socks: list[zmq.Socket[bytes]] = []

    def open_tap(endpoint: str, rcvhwm: int = 1000) -> zmq.Socket[bytes]:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        socks.append(sock)
        return sock

    yield open_tap  # type: ignore[misc]
    for sock in socks:
        sock.close(0)
    ctx.term()


# -- the format, read by vLLM --------------------------------------------------------
def test_late_subscriber_replays_every_event_vllm_decodes_them_and_replicas_agree(
    daemon_factory: Callable[..., Daemon],
    vllm_python: Path,  # noqa: F811
) -> None:
    tokens = prompt(1, 3)
    keys = chunk_keys(tokens, CHUNK)
    streams = []
    for node in ("node-a", "node-b"):  # two replicas' daemons, same prefix
        daemon = events_daemon(daemon_factory, node=node)
        with daemon.client(namespace=NS) as c:
            assert c.hello()["events"] == {"block_size": BLOCK, "tokens_frame": True}
            assert (
                c.put(keys, [os.urandom(4096) for _ in keys], tokens=chunk_tokens(tokens, CHUNK))
                == [PutStatus.STORED] * 3
            )
            # A late subscriber: it joins after everything was published.
            frames = all_batches(daemon, c, announced_chunks=3)
        batches = decode_with_vllm(vllm_python, frames)
        assert [b["seq"] for b in batches] == [seq for _, seq, _ in frames]
        assert {b["topic"] for b in batches} == {f"kv@{node}@{MODEL}"}
        assert {b["data_parallel_rank"] for b in batches} == {0}
        stored = events_of(batches)
        assert [e["type"] for e in stored] == ["BlockStored"] * 3
        parents = [ROOT_KEY, *keys[:-1]]
        previous = None
        for i, event in enumerate(stored):
            want = expected_hashes(keys[i], parents[i], chunk(tokens, i))
            assert event["block_hashes"] == want
            assert event["parent_block_hash"] == previous  # None for the first chunk
            assert event["token_ids"] == chunk(tokens, i)
            assert event["block_size"] == BLOCK and event["medium"] == "CPU"
            assert event["lora_id"] is None and event["lora_name"] is None
            previous = want[-1]
        streams.append([(e["block_hashes"], e["parent_block_hash"], e["token_ids"]) for e in stored])
    assert streams[0] == streams[1]  # every replica announces the same hashes for the same prefix


def test_put_spill_delete_corrupt_clear_gives_exactly_the_expected_events(
    daemon_factory: Callable[..., Daemon],
    tmp_path: Path,
    vllm_python: Path,  # noqa: F811
) -> None:
    root = tmp_path / "spill"
    daemon = events_daemon(
        daemon_factory,
        local_disk=f"file://{root}",
        max_local_cpu_size="8MiB",
        max_local_disk_size="64MiB",
        spill_ahead_size=0,
    )
    tokens = prompt(2, 3)
    keys = chunk_keys(tokens, CHUNK)
    toks = chunk_tokens(tokens, CHUNK)
    size = 1 << 20
    with daemon.client(namespace=NS) as c:
        assert c.put(keys[:2], [os.urandom(size), os.urandom(size)], tokens=toks[:2]) == [PutStatus.STORED] * 2
        # Fill the pool with chunks that say nothing of their tokens: A and B spill to disk.
        fillers = [os.urandom(32) for _ in range(12)]
        for f in fillers:
            assert c.put([f], [os.urandom(size)]) == [PutStatus.STORED]
        wait_for(
            lambda: c.lookup(keys[:2]).tiers == ["disk", "disk"] and c.stats()["tiers"]["disk"]["queued_spills"] == 0
        )
        assert quiet(c)["removed_chunks"] == 0  # a spill is no removal: a medium change
        assert c.delete(keys[:1]) == [True]
        quiet(c, removed_chunks=1)
        # B's file is damaged: the read finds out, B leaves the node.
        path = Path(path_for(root, ChunkKey(NS, keys[1])))
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF  # inside the payload
        path.write_bytes(bytes(data))
        assert c.get(keys[1:2]) == [None]
        quiet(c, removed_chunks=2)
        assert c.put(keys[2:], [os.urandom(size)], tokens=toks[2:]) == [PutStatus.STORED]
        quiet(c, announced_chunks=3)
        assert c.clear() > 0
        frames = all_batches(daemon, c, clears=1)
    events = events_of(decode_with_vllm(vllm_python, frames))
    a, b, third = (expected_hashes(keys[i], [ROOT_KEY, *keys][i], chunk(tokens, i)) for i in range(3))
    # A and B leave memory after their spill: the same blocks, now on disk (STORAGE).
    assert [(e["type"], e.get("block_hashes"), e.get("medium")) for e in events] == [
        ("BlockStored", a, "CPU"),
        ("BlockStored", b, "CPU"),
        ("BlockStored", a, "STORAGE"),
        ("BlockRemoved", a, "CPU"),
        ("BlockStored", b, "STORAGE"),
        ("BlockRemoved", b, "CPU"),
        ("BlockRemoved", a, "STORAGE"),
        ("BlockRemoved", b, "STORAGE"),
        ("BlockStored", third, "CPU"),
        ("AllBlocksCleared", None, None),
    ]
    assert events[2]["parent_block_hash"] is None and events[4]["parent_block_hash"] == a[-1]
    assert events[8]["parent_block_hash"] == b[-1]  # chains to B, though B left
    assert all(e["locality"] == "LOCAL" for e in events[:9])


def test_eviction_without_a_disk_removes_and_shared_blocks_are_announced_once(
    daemon_factory: Callable[..., Daemon],
) -> None:
    daemon = events_daemon(daemon_factory, max_local_cpu_size="4MiB")
    base = prompt(3, 1)
    other = base[:32] + [t + 1 for t in base[32:]]  # the same first two blocks, then different
    ka, kb = chunk_keys(base, CHUNK)[0], chunk_keys(other, CHUNK)[0]
    ta, tb = chunk_tokens(base, CHUNK)[0], chunk_tokens(other, CHUNK)[0]
    with daemon.client(namespace=NS) as c:
        assert c.put([ka, kb], [os.urandom(4096)] * 2, tokens=[ta, tb]) == [PutStatus.STORED] * 2
        quiet(c, announced_chunks=2)
        assert c.delete([ka]) == [True]
        quiet(c, removed_chunks=1)
        # Without a disk, an evicted chunk leaves the node at once.
        for _ in range(8):
            c.put([os.urandom(32)], [os.urandom(1 << 20)])
        wait_for(lambda: not c.exists([kb])[0])
        events = events_of(decode(all_batches(daemon, c, removed_chunks=2)))
    ha, hb = expected_hashes(ka, ROOT_KEY, base), expected_hashes(kb, ROOT_KEY, other)
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    assert [e["type"] for e in events] == ["BlockStored", "BlockStored", "BlockRemoved", "BlockRemoved"]
    assert events[0]["block_hashes"] == ha
    # B's first two blocks were announced by A: only the rest, chained to them.
    assert events[1]["block_hashes"] == hb[2:] and events[1]["parent_block_hash"] == hb[1]
    assert events[1]["token_ids"] == other[32:]
    assert events[2]["block_hashes"] == ha[2:]  # the shared blocks stay: B holds them
    assert events[3]["block_hashes"] == hb  # evicted: every block of B, the shared ones included


def test_live_subscriber_sees_batches_in_order_and_old_clients_are_not_announced(
    daemon_factory: Callable[..., Daemon], tap: Callable[..., zmq.Socket[bytes]]
) -> None:
    daemon = events_daemon(daemon_factory)
    sub = tap(daemon.events)  # type: ignore[attr-defined]
    tokens = prompt(4, 40)
    keys, toks = chunk_keys(tokens, CHUNK), chunk_tokens(tokens, CHUNK)
    received: list[Frames] = []
    with daemon.client(namespace=NS) as c:
        # The subscription reaches the PUB socket asynchronously: put until one batch arrives.
        i = 0
        while not received:
            assert i < len(keys), "no batch reached a live subscriber"
            assert c.put([os.urandom(32)], [b"x" * 4096]) == [PutStatus.STORED]  # an old client: no tokens
            c.put(keys[i : i + 1], [b"x" * 4096], tokens=toks[i : i + 1])
            i += 1
            if sub.poll(200):
                topic, seq, payload = sub.recv_multipart()
                received.append((topic, int.from_bytes(seq, "big"), payload))
        c.put(keys[i:], [b"x" * 4096] * (len(keys) - i), tokens=toks[i:])
        stats = quiet(c, announced_chunks=len(keys))
    total = stats["next_seq"]
    while received[-1][1] < total - 1:
        assert sub.poll(10_000), "a live batch went missing"
        topic, seq, payload = sub.recv_multipart()
        received.append((topic, int.from_bytes(seq, "big"), payload))
    seqs = [s for _, s, _ in received]
    assert seqs == list(range(seqs[0], total))
    assert stats["announced_chunks"] == len(keys)  # the chunks put without tokens were not announced
    last = events_of(decode(received[-1:]))[-1]
    assert last["block_hashes"][-1] == h63(keys[-1])


# -- bad input ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bad_input_daemon(module_daemon_factory: Callable[..., Daemon]) -> Daemon:
    return module_daemon_factory(events_endpoint=f"tcp://127.0.0.1:{free_port()}")


@pytest.mark.parametrize(
    "entry, message",
    [
        pytest.param("swapped", "do not hash to keys[0]", id="another-chunks-tokens"),
        pytest.param([ROOT_KEY, b"\x01\x02\x03"], "packed u32le", id="not-a-multiple-of-4"),
        pytest.param([b"short", b"\x00" * 4], "32-byte key", id="short-parent"),
        pytest.param([1, 2, 3], "must be nil or", id="not-a-pair"),
        pytest.param("wrong-count", "one entry per key", id="wrong-count"),
    ],
)
def test_bad_token_ids_get_a_clear_error_and_nothing_is_stored(
    bad_input_daemon: Daemon, entry: Any, message: str
) -> None:
    daemon = bad_input_daemon
    tokens = prompt(5, 2)
    keys, toks = chunk_keys(tokens, CHUNK), chunk_tokens(tokens, CHUNK)
    if entry == "swapped":
        field: Any = [list(toks[1]), list(toks[0])]
    elif entry == "wrong-count":
        field = [list(toks[0])]
    else:
        field = [entry, list(toks[1])]
    with daemon.client(namespace=NS) as c:
        # The raw field, as a client that gets it wrong would send it.
        from lmcache_client import calls

        call = calls.put(NS, keys, [b"x" * 4096] * 2)
        call.fields["tokens"] = field
        with pytest.raises(ServerError) as err:
            c._run(call)
        assert err.value.code == ErrorCode.BAD_REQUEST and message in str(err.value)
        assert c.exists(keys) == [False, False]
        # ... and the same put with good token ids, or none, is stored.
        assert c.put(keys[:1], [b"x" * 4096], tokens=toks[:1]) == [PutStatus.STORED]
        assert c.put(keys[1:], [b"x" * 4096]) == [PutStatus.STORED]
        c.delete(keys)


def test_token_ids_need_one_entry_per_key_in_the_client() -> None:
    with pytest.raises(ValueError, match="token entries"):
        from lmcache_client import calls

        calls.put(NS, [b"k" * 32], [b"x"], [ChunkTokens(ROOT_KEY, b"\0" * 4)] * 2)


def test_events_config_is_checked_at_start() -> None:
    env: dict[str, str] = {}
    with pytest.raises(ConfigError, match="events_block_size"):
        load_config(environ=env, overrides={"events_block_size": 24})
    with pytest.raises(ConfigError, match="events_topic"):
        load_config(environ=env, overrides={"events_topic": "kv@{pod}"})
    with pytest.raises(ConfigError, match="events_replay_endpoint"):
        load_config(environ=env, overrides={"events_replay_endpoint": "tcp://127.0.0.1:5558"})
    with pytest.raises(ConfigError, match="events_endpoint"):
        load_config(environ=env, overrides={"events_endpoint": "udp://x"})
    config = load_config(environ=env, overrides={"events_endpoint": "tcp://*:5557", "events_block_size": 64})
    assert config.events_block_size == 64 and config.events_topic == "kv@{node}@{model}"


def test_an_exposed_events_endpoint_needs_allow_insecure(daemon_factory: Callable[..., Daemon]) -> None:
    with pytest.raises(RuntimeError, match="events_endpoint.*token ids"):
        daemon_factory(events_endpoint=f"tcp://*:{free_port()}")


# -- a slow subscriber -------------------------------------------------------------------
def test_a_stalled_subscriber_never_holds_up_puts_and_replays_what_it_lost(
    daemon_factory: Callable[..., Daemon], tap: Callable[..., zmq.Socket[bytes]], tmp_path: Path
) -> None:
    # ipc: the kernel buffers little of a Unix socket, so the high-water marks decide.
    daemon = events_daemon(
        daemon_factory,
        events_hwm=4,
        events_batch_max_events=1,
        events_replay_size="256MiB",
        events_endpoint=f"ipc://{tmp_path}/events.sock",
    )
    stalled = tap(daemon.events, rcvhwm=4)  # type: ignore[attr-defined]
    tokens = prompt(6, 2000)
    keys, toks = chunk_keys(tokens, CHUNK), chunk_tokens(tokens, CHUNK)
    with daemon.client(namespace=NS) as c:
        for start in range(0, len(keys), 50):  # one batch per chunk: far past both high-water marks
            part = slice(start, start + 50)
            assert c.put(keys[part], [b"x" * 4096] * len(keys[part]), tokens=toks[part]) == [PutStatus.STORED] * len(
                keys[part]
            )
        stats = quiet(c, announced_chunks=len(keys))
        first, total = stats["first_seq"], stats["next_seq"]
        assert total - first == len(keys) + 1  # the start batch, then one batch per chunk
    got = []
    while stalled.poll(500):
        got.append(int.from_bytes(stalled.recv_multipart()[1], "big"))
    assert len(got) < total - first  # it lost batches past its high-water mark ...
    missing = sorted(set(range(first, total)) - set(got))
    recovered = replay(daemon, missing[0])  # ... and replay has every one of them
    assert set(missing) <= {seq for _, seq, _ in recovered}
    assert [s for _, s, _ in recovered] == list(range(missing[0], total))


def test_a_chunk_stored_without_token_ids_is_announced_when_put_again_with_them(
    daemon_factory: Callable[..., Daemon],
) -> None:
    daemon = events_daemon(daemon_factory)
    tokens = prompt(7, 1)
    keys, toks = chunk_keys(tokens, CHUNK), chunk_tokens(tokens, CHUNK)
    with daemon.client(namespace=NS) as c:
        assert c.put(keys, [b"x" * 4096]) == [PutStatus.STORED]  # an older client
        assert quiet(c)["announced_chunks"] == 0
        assert c.put(keys, [b"x" * 4096], tokens=toks) == [PutStatus.EXISTS]
        assert c.put(keys, [b"x" * 4096], tokens=toks) == [PutStatus.EXISTS]  # once only
        events = events_of(decode(all_batches(daemon, c, announced_chunks=1)))
    assert [(e["type"], e["block_hashes"]) for e in events] == [
        ("BlockStored", expected_hashes(keys[0], ROOT_KEY, tokens))
    ]


def test_adapters_send_token_ids_only_to_a_daemon_that_publishes_events(
    daemon_factory: Callable[..., Daemon],
) -> None:
    from lmcache_client.integrations.transfer import ChunkTransfer

    tokens = prompt(8, 2)
    keys, toks = chunk_keys(tokens, CHUNK), chunk_tokens(tokens, CHUNK)
    with_events, without = events_daemon(daemon_factory), daemon_factory()
    for daemon, announced in ((with_events, True), (without, False)):
        with daemon.client(namespace=NS) as c:
            transfer = ChunkTransfer(c, NS, 4096)
            assert transfer.wants_tokens() is announced
            assert transfer.put(keys, [b"x" * 4096] * 2, toks) == 2
            if announced:
                assert quiet(c, announced_chunks=2)["announced_chunks"] == 2
            else:
                assert "events" not in c.stats()


def test_the_replay_buffer_is_bounded_in_bytes_and_gap_free() -> None:
    from lmcache_server.events.replay import ReplayBuffer

    buffer = ReplayBuffer(max_bytes=10_000)
    for seq in range(100):
        buffer.append(seq, b"t", bytes(999))  # 1000 bytes with the topic
    assert buffer.nbytes <= 10_000 and len(buffer) == 10
    assert [s for s, _, _ in buffer.since(0)] == list(range(90, 100))  # the oldest fell out
    assert [s for s, _, _ in buffer.since(95)] == list(range(95, 100))
    assert buffer.since(100) == []
    buffer.append(100, b"t", bytes(50_000))  # larger than the bound: kept alone
    assert [s for s, _, _ in buffer.since(0)] == [100]
