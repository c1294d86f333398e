"""A real vLLM 0.32 OpenAI server run with ``--kv-events-config`` (docs/events.md):
the connector's events reach vLLM's own KV-event stream, and its puts carry
token ids into the daemon's stream.

The replica is started with the command line of docs/integrations.md (run
verbatim) plus ``--kv-events-config``; both streams are read back by replay and
decoded with vLLM's own ``KVEventBatch`` decoder.  One prompt of two full chunks
and a few tokens:

- vLLM's stream has the connector's ``BlockStored`` events, medium ``CPU``,
  covering the prompt's 4 full-chunk blocks with vLLM's own block hashes (the
  same hashes as vLLM's own ``GPU`` events for those blocks) and their token ids;
- the daemon's stream announces the same two chunks with the same token ids.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq

from ...conftest import Daemon, free_port, wait_for
from ...events.test_events import END_SEQ, decode, decode_with_vllm, events_daemon, events_of, quiet, replay
from .vllm_harness.fixtures import Server, doc_command, server_env
from .vllm_harness.models import prompt_tokens

pytestmark = pytest.mark.timeout(1800)
CHUNK = 256  # the connector's default
BLOCK = 128  # vLLM's block size on its CPU backend (the daemon announces blocks of the same size)


def replay_from(endpoint: str) -> list[tuple[bytes, int, bytes]]:
    """vLLM's replay endpoint, from sequence 0 to its end marker."""
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(30_000), "vLLM's replay endpoint did not answer"
            _, topic, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((topic, int.from_bytes(seq, "big"), payload))


def test_replica_publishes_the_connectors_events_and_its_puts_carry_token_ids(
    daemon_factory: Callable[..., Daemon],
    vllm_python: Path,
    models: dict[str, Path],
    tmp_path: Path,
) -> None:
    daemon = events_daemon(daemon_factory, max_local_cpu_size="1GiB", events_block_size=BLOCK)
    pub, rep, http = free_port(), free_port(), free_port()
    events_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{pub}",
        "replay_endpoint": f"tcp://127.0.0.1:{rep}",
        "topic": "kv@replica-a@test",
    }
    command = doc_command().rstrip() + f" \\\n  --kv-events-config '{json.dumps(events_config)}'\n"
    env = server_env(vllm_python, models["llama"], http, daemon.address)
    server = Server(command, env, http, tmp_path / "server.log")
    try:
        server.wait_ready()
        prompt = prompt_tokens(2 * CHUNK + 20, seed=31)
        out = server.post(
            "/v1/completions",
            {"model": str(models["llama"]), "prompt": prompt, "max_tokens": 2, "temperature": 0},
        )
        assert out["choices"][0]["text"]

        seen: list[dict[str, Any]] = []

        def connector_events() -> list[tuple[bytes, int, bytes]] | None:
            frames = replay_from(events_config["replay_endpoint"])
            seen[:] = events_of(decode(frames))  # msgpack here; vLLM's own decoder once, below
            ours = [e for e in seen if e["type"] == "BlockStored" and e["medium"] == "CPU"]
            return frames if sum(len(e["block_hashes"]) for e in ours) >= 2 * CHUNK // BLOCK else None

        try:
            frames = wait_for(connector_events, timeout_s=120)
        except AssertionError:
            summary = [(e["type"], e.get("medium"), len(e.get("block_hashes", []))) for e in seen]
            raise AssertionError(f"vLLM's stream: {summary}") from None
        events = events_of(decode_with_vllm(vllm_python, frames))
    finally:
        server.stop()
    ours = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "CPU"]
    gpu = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "GPU"]
    hashes = [h for e in ours for h in e["block_hashes"]]
    assert len(hashes) == 2 * CHUNK // BLOCK == len(set(hashes))
    assert [t for e in ours for t in e["token_ids"]] == prompt[: 2 * CHUNK]
    assert all(e["block_size"] == BLOCK for e in ours)
    assert ours[0]["parent_block_hash"] is None
    # vLLM's own hashes: the replica's GPU events name the same blocks the same way.
    gpu_hashes = [h for e in gpu for h in e["block_hashes"]]
    assert hashes == gpu_hashes[: len(hashes)]
    # The connector's puts carried the token ids: the daemon announced both chunks.
    with daemon.client(namespace=None) as c:
        quiet(c, announced_chunks=2)
    stored = events_of(decode_with_vllm(vllm_python, replay(daemon)))
    assert [t for e in stored if e["type"] == "BlockStored" for t in e["token_ids"]] == prompt[: 2 * CHUNK]
