"""Who may ask ``POST /query`` (issue 39 item 5; docs/security.md, "POST /query"),
against real daemons with ``auth: curve``, ``allow_insecure`` and a non-loopback
``metrics_host`` (what a curve deployment with routers on the network runs):

- without ``query_tokens_file`` the endpoint is off (before: ``allow_insecure``
  opened it to anyone, every tenant's prefixes and namespace names);
- with it, a query without a valid bearer token is refused (401); tenant b's
  token gets a 404 for tenant a's prefix, the same status and body as before
  tenant a stored it (no existence oracle), and a model query lists only b's
  namespaces; the admin token sees both;
- ``admin who-has`` sends the token (``--token-file``);
- the tokens file is refused when others may read it or a token is short.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from lmcache_client.keys import chunk_keys
from lmcache_client.protocol import PutStatus
from lmcache_server.adminwhohas import main as who_has
from lmcache_server.config import ConfigError, load_config
from lmcache_server.security.querytokens import QueryAccess

from ..conftest import Daemon
from .test_security import NS_A, NS_B, Keys, start_daemon, stop

CHUNK = 16  # the namespaces' c16
TOKENS = list(range(1000, 1000 + 4 * CHUNK))


def post(daemon: Daemon, body: Any, token: str | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    conn = http.client.HTTPConnection("127.0.0.1", daemon.metrics_port, timeout=10)
    try:
        conn.request("POST", "/query", body=json.dumps(body).encode(), headers=headers)
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read() or b"null")
    finally:
        conn.close()


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return Keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    names = {"admin": secrets.token_hex(32), "b": secrets.token_hex(32)}
    path = tmp_path_factory.mktemp("query-tokens") / "query-tokens.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "tokens": {
                    "router": {"token": names["admin"], "admin": True},
                    "router-b": {"token": names["b"], "grants": [{"tenant": "b"}]},
                }
            }
        )
    )
    path.chmod(0o600)
    return {**names, "file": str(path)}


def _insecure_curve(keys: Keys, **extra: Any) -> dict[str, Any]:
    # allow_insecure is what a curve deployment needs for events on the network; the
    # metrics port on every interface is what the shipped k8s and docker configs bind.
    return {**keys.config(), "allow_insecure": True, "metrics_host": "0.0.0.0", **extra}


@pytest.fixture(scope="module")
def tokened(keys: Keys, tokens: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    config = _insecure_curve(keys, query_tokens_file=tokens["file"])
    daemon = start_daemon(tmp_path_factory.mktemp("tokened"), config, **keys.options("admin"))
    try:
        yield daemon
    finally:
        stop(daemon)


def _store(daemon: Daemon, keys: Keys, tenant: str, namespace: str) -> None:
    with daemon.client(namespace=namespace, **keys.options(tenant)) as c:
        got = c.put(chunk_keys(TOKENS, CHUNK), [os.urandom(4096)] * 4)
        assert set(got) <= {PutStatus.STORED, PutStatus.EXISTS}


def test_without_a_tokens_file_allow_insecure_does_not_open_query(keys: Keys, tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, _insecure_curve(keys), **keys.options("admin"))
    try:
        _store(daemon, keys, "tenant-a", NS_A)
        status, answer = post(daemon, {"namespace": NS_A, "tokens": TOKENS})
        assert status == 403 and "query_tokens_file" in answer["error"]
        assert post(daemon, {"model": "m", "tokens": TOKENS})[0] == 403
    finally:
        stop(daemon)


def test_a_token_is_required_and_answers_for_its_tenant_only(
    tokened: Daemon, keys: Keys, tokens: dict[str, Any]
) -> None:
    absent = post(tokened, {"namespace": NS_A, "tokens": TOKENS}, tokens["b"])  # before tenant a stores
    assert absent[0] == 404
    _store(tokened, keys, "tenant-a", NS_A)
    _store(tokened, keys, "tenant-b", NS_B)
    # No token, a wrong one, another scheme: refused alike, before the body is read.
    refused = [
        post(tokened, {"namespace": NS_A, "tokens": TOKENS}),
        post(tokened, {"namespace": NS_A, "tokens": TOKENS}, secrets.token_hex(32)),
        post(tokened, {"namespace": NS_A, "tokens": TOKENS}, tokens["b"][:-1]),
    ]
    assert {status for status, _ in refused} == {401}
    assert len({json.dumps(answer) for _, answer in refused}) == 1
    # Tenant b's token: tenant a's prefix is what an absent one is, status and body.
    assert post(tokened, {"namespace": NS_A, "tokens": TOKENS}, tokens["b"]) == absent
    status, mine = post(tokened, {"namespace": NS_B, "tokens": TOKENS}, tokens["b"])
    assert status == 200 and mine["best"]["prefix_tokens"] == 4 * CHUNK
    status, by_model = post(tokened, {"model": "m", "tokens": TOKENS}, tokens["b"])
    assert status == 200 and [e["namespace"] for e in by_model["namespaces"]] == [NS_B]
    # The admin token sees every tenant.
    status, everyone = post(tokened, {"model": "m", "tokens": TOKENS}, tokens["admin"])
    assert status == 200 and sorted(e["namespace"] for e in everyone["namespaces"]) == sorted([NS_A, NS_B])
    assert all(e["prefix_tokens"] == 4 * CHUNK for e in everyone["namespaces"])


def test_who_has_sends_the_token(
    tokened: Daemon, keys: Keys, tokens: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _store(tokened, keys, "tenant-b", NS_B)
    node = f"http://127.0.0.1:{tokened.metrics_port}"
    ids = ",".join(map(str, TOKENS))
    assert who_has(["--nodes", node, "--namespace", NS_B, "--tokens", ids]) == 1
    assert "401" in capsys.readouterr().out
    token_file = tmp_path / "token"
    token_file.write_text(tokens["b"] + "\n")
    assert who_has(["--nodes", node, "--namespace", NS_B, "--tokens", ids, "--token-file", str(token_file)]) == 0
    assert f"{4 * CHUNK} of {len(TOKENS)} tokens" in capsys.readouterr().out


@pytest.mark.parametrize(
    "entry, mode, message",
    [
        pytest.param({"token": "x" * 40, "admin": True}, 0o644, "chmod 600", id="readable-by-others"),
        pytest.param({"token": "short", "admin": True}, 0o600, "at least 32", id="short-token"),
        pytest.param({"token": "x" * 40}, 0o600, "either admin", id="no-scope"),
        pytest.param({"token": "x" * 40, "grants": [{"tenant": "a", "access": "rw"}]}, 0o600, "ro", id="rw-grant"),
    ],
)
def test_a_bad_tokens_file_is_refused_at_start(tmp_path: Path, entry: dict[str, Any], mode: int, message: str) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text(yaml.safe_dump({"tokens": {"t": entry}}))
    path.chmod(mode)
    config = load_config(None, environ={}, overrides={"query_tokens_file": str(path)})
    with pytest.raises(ConfigError, match="query_tokens_file") as err:
        QueryAccess.from_config(config)
    assert message in str(err.value)


def test_without_a_tokens_file_only_a_loopback_metrics_host_without_auth_is_open() -> None:
    def scope(**overrides: Any) -> Any:
        return QueryAccess.from_config(load_config(None, environ={}, overrides=overrides)).scope(None)

    assert scope(metrics_host="127.0.0.1") is not None
    assert scope(metrics_host="::1") is not None
    assert scope(metrics_host="0.0.0.0") is None
    assert scope(metrics_host="0.0.0.0", allow_insecure=True) is None
