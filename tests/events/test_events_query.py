"""``POST /query`` on the metrics port and ``lmcache-server admin who-has``
(docs/events.md, "Query"), against the real daemon:

- the answer agrees with the daemon's own ``lookup`` (leading hits, and the
  tier of each: memory -> CPU, disk -> STORAGE), by namespace and by model;
- the chain root: a salted prompt is found with its salt only;
- bad requests get a clear 4xx and the daemon keeps serving (who may ask, and
  the cost of a query: security/test_query_access.py, server/test_query_load.py);
- who-has asks several nodes and names the one holding the longest prefix.
"""

from __future__ import annotations

import http.client
import json
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lmcache_client.integrations.vllm.scheduler import key_root
from lmcache_client.keys import chunk_keys
from lmcache_client.protocol import PutStatus
from lmcache_server.adminwhohas import _rank
from lmcache_server.adminwhohas import main as who_has
from lmcache_server.server.query import MAX_TOKENS

from ..conftest import Daemon, wait_for
from .test_events import CHUNK, MODEL, NS

SIZE = 1 << 20


def post(daemon: Daemon, body: Any, raw: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", daemon.metrics_port, timeout=10)
    try:
        data = raw if raw is not None else json.dumps(body).encode()
        conn.request("POST", "/query", body=data, headers=headers or {"Content-Type": "application/json"})
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read() or b"null")
    finally:
        conn.close()


@pytest.fixture(scope="module")
def node(module_daemon_factory: Callable[..., Daemon], tmp_path_factory: pytest.TempPathFactory) -> Daemon:
    """A daemon with a prompt of 6 chunks: the first 2 spilled to disk, the rest in memory."""
    root = tmp_path_factory.mktemp("query")
    daemon = module_daemon_factory(
        local_disk=f"file://{root}",
        max_local_cpu_size="6MiB",
        max_local_disk_size="64MiB",
        spill_ahead_size=0,
        cache_policy="lru",
    )
    tokens = list(range(6 * CHUNK))
    keys = chunk_keys(tokens, CHUNK)
    with daemon.client(namespace=NS) as c:
        assert c.put(keys[:2], [os.urandom(SIZE)] * 2) == [PutStatus.STORED] * 2
        for _ in range(6):
            c.put([os.urandom(32)], [os.urandom(SIZE)])  # push the first two out to disk
        wait_for(lambda: c.lookup(keys[:2]).tiers == ["disk", "disk"])
        assert c.put(keys[2:5], [os.urandom(SIZE)] * 3) == [PutStatus.STORED] * 3  # chunk 5 is missing
        salted = chunk_keys(tokens, CHUNK, key_root(_request(salt="s1")))
        assert c.put(salted[:1], [os.urandom(SIZE)]) == [PutStatus.STORED]
    daemon.tokens = tokens  # type: ignore[attr-defined]
    return daemon


def _request(salt: str | None = None) -> Any:
    return SimpleNamespace(cache_salt=salt, lora_request=None, mm_features=None, prompt_embeds=None)


def test_the_answer_agrees_with_lookup_by_namespace_and_by_model(node: Daemon) -> None:
    tokens = node.tokens  # type: ignore[attr-defined]
    keys = chunk_keys(tokens, CHUNK)
    with node.client(namespace=NS) as c:
        found = c.lookup(keys)
    medium = {"memory": "CPU", "disk": "STORAGE"}
    want: dict[str, int] = {}
    for tier in found.tiers[: found.hit_chunks]:
        want[medium[tier]] = want.get(medium[tier], 0) + CHUNK
    assert found.hit_chunks == 5 and want == {"STORAGE": 2 * CHUNK, "CPU": 3 * CHUNK}
    status, answer = post(node, {"namespace": NS, "tokens": tokens + [7] * 100})  # + a partial chunk
    assert status == 200
    assert answer["best"] == {"namespace": NS, "chunk_size": CHUNK, "prefix_tokens": 5 * CHUNK, "by_medium": want}
    status, by_model = post(node, {"model": MODEL, "tokens": tokens})
    assert status == 200 and by_model["best"] == answer["best"]
    # A prompt that diverges inside chunk 3: the first three chunks only.
    other = tokens[: 3 * CHUNK + 5] + [1] * (3 * CHUNK - 5)
    assert post(node, {"namespace": NS, "tokens": other})[1]["best"]["prefix_tokens"] == 3 * CHUNK


def test_the_chain_root_follows_the_salt(node: Daemon) -> None:
    tokens = node.tokens  # type: ignore[attr-defined]
    salted = post(node, {"namespace": NS, "tokens": tokens, "salt": "s1"})[1]["best"]
    assert salted["prefix_tokens"] == CHUNK and salted["by_medium"] == {"CPU": CHUNK}
    assert post(node, {"namespace": NS, "tokens": tokens, "salt": "s2"})[1]["best"]["prefix_tokens"] == 0


@pytest.mark.parametrize(
    "body, raw, status, message",
    [
        pytest.param(None, b"{not json", 400, "not JSON", id="not-json"),
        pytest.param([1, 2], None, 400, "JSON object", id="not-an-object"),
        pytest.param({"namespace": NS, "tokens": "1,2"}, None, 400, "list of token ids", id="tokens-a-string"),
        pytest.param({"namespace": NS, "tokens": [-1]}, None, 400, "list of token ids", id="negative-id"),
        pytest.param({"namespace": NS, "tokens": [0] * (MAX_TOKENS + 1)}, None, 400, "at most", id="too-many"),
        pytest.param({"tokens": [1]}, None, 400, "exactly one of", id="no-namespace"),
        pytest.param({"namespace": "nope|x", "tokens": [1]}, None, 404, "holds nothing", id="unknown-namespace"),
        pytest.param({"model": "nope", "tokens": [1]}, None, 404, "holds nothing", id="unknown-model"),
        pytest.param({"namespace": NS, "tokens": [1], "chunk_size": 1}, None, 400, "chunk_size", id="chunk-size"),
        pytest.param({"namespace": NS, "tokens": [1], "tags": [""]}, None, 400, "tags", id="empty-tag"),
    ],
)
def test_bad_queries_get_a_clear_error_and_the_daemon_keeps_serving(
    node: Daemon, body: Any, raw: bytes | None, status: int, message: str
) -> None:
    got, answer = post(node, body, raw)
    assert got == status and message in answer["error"]
    assert post(node, {"namespace": NS, "tokens": node.tokens})[0] == 200  # type: ignore[attr-defined]


def test_the_body_size_is_bounded_and_must_be_announced(node: Daemon) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", node.metrics_port, timeout=10)
    try:
        conn.putrequest("POST", "/query")
        conn.putheader("Content-Length", str(64 << 20))
        conn.endheaders()
        reply = conn.getresponse()
        assert reply.status == 413 and "at most" in json.loads(reply.read())["error"]
    finally:
        conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", node.metrics_port, timeout=10)
    try:
        conn.putrequest("POST", "/query", skip_accept_encoding=True)
        conn.endheaders()
        assert conn.getresponse().status == 411
    finally:
        conn.close()


def test_who_has_names_the_node_with_the_longest_prefix(
    node: Daemon, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    tokens = node.tokens  # type: ignore[attr-defined]
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(tokens))
    me, gone = f"http://127.0.0.1:{node.metrics_port}", "http://127.0.0.1:9"
    assert who_has(["--nodes", f"{gone},{me}", "--model", MODEL, "--tokens-file", str(ids), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["best"] == me and "error" in out["nodes"][gone]
    assert out["nodes"][me]["best"]["prefix_tokens"] == 5 * CHUNK
    assert who_has(["--nodes", me, "--namespace", NS, "--tokens", "5,6,7"]) == 1  # no full chunk: nobody
    assert "best: none" in capsys.readouterr().out
    assert who_has(["--nodes", me, "--namespace", NS, "--tokens", "x"]) == 2


def test_who_has_prefers_a_prefix_held_on_the_node_over_one_only_redis_holds() -> None:
    def answer(prefix: int, **media: int) -> dict[str, Any]:
        return {"best": {"prefix_tokens": prefix, "by_medium": media}}

    ranked = sorted(
        [answer(512, REMOTE=512), answer(512, STORAGE=512), answer(512, CPU=256, REMOTE=256), answer(768, REMOTE=768)],
        key=_rank,
        reverse=True,
    )
    assert [a["best"]["by_medium"] for a in ranked] == [
        {"REMOTE": 768},  # the longest prefix first
        {"STORAGE": 512},  # then the most on the node itself
        {"CPU": 256, "REMOTE": 256},
        {"REMOTE": 512},
    ]
