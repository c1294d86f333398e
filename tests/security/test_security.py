"""Security: CURVE authentication, tenant grants, exposure checks, key files, per-client limits.

Real daemon processes, real CURVE handshakes over real sockets; keys come from
the ``lmcache-server keygen`` command itself.  Nothing here measures time:
refused connections are observed as DaemonUnavailable after a request timeout.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import yaml
import zmq
import zmq.auth

from lmcache_client import AsyncCacheClient, CacheClient, DaemonUnavailable, ErrorCode, PutStatus, ServerError
from lmcache_client.curve import (
    CurveKeys,
    KeyFileError,
    check_private_file,
    read_public_key,
    read_secret_key,
    write_keypair,
)
from lmcache_client.protocol import KEY_BYTES
from lmcache_server.config import ConfigError, load_config
from lmcache_server.server.inflight import ClientLedger

from ..conftest import NAMESPACE, Daemon, wait_for
from ..metrics.test_metrics import sample, scrape
from ..server._zmtp import RawDealer

NS_A = "m|float16|L2|KV2|D64|tp0of1|c16|tenant=a"
NS_B = "m|float16|L2|KV2|D64|tp0of1|c16|tenant=b"
NS_SHARED = "shared/m|float16|L2|KV2|D64|tp0of1|c16"
MiB = 1 << 20
REFUSED_TIMEOUT_S = 1.0
"""How long a request waits on a connection whose handshake the daemon refuses."""


def lmcache_server(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    return subprocess.run(
        [sys.executable, "-m", "lmcache_server", *args], capture_output=True, text=True, timeout=60, env=env
    )  # fmt: skip


def key(i: int) -> bytes:
    return bytes([i]) * KEY_BYTES


# -- fixtures --------------------------------------------------------------------------------
class Keys:
    """Key pairs made with ``lmcache-server keygen`` and the client keys file naming them."""

    NAMES = ("server", "tenant-a", "tenant-b", "reader-a", "shared-ro", "admin", "stranger")

    def __init__(self, folder: Path):
        self.folder = folder
        for name in self.NAMES:
            out = lmcache_server("keygen", name, "--dir", str(folder))
            assert out.returncode == 0, out.stderr
        clients = {
            "tenant-a": {"public_key": "tenant-a.key", "grants": [{"tenant": "a", "access": "rw"}]},
            "tenant-b": {
                "public_key": read_public_key(str(folder / "tenant-b.key")).decode(),  # Z85 inline
                "grants": [{"tenant": "b", "access": "rw"}, {"prefix": "shared/", "access": "rw"}],
            },
            "reader-a": {"public_key": "reader-a.key", "grants": [{"tenant": "a", "access": "ro"}]},
            "shared-ro": {"public_key": "shared-ro.key", "grants": [{"prefix": "shared/", "access": "ro"}]},
            "admin": {"public_key": "admin.key", "admin": True},
        }  # "stranger" has a valid key pair the daemon does not know
        self.clients_file = folder / "clients.yaml"
        self.clients_file.write_text(yaml.safe_dump({"clients": clients}))

    def secret(self, name: str) -> str:
        return str(self.folder / f"{name}.key_secret")

    @property
    def server_public(self) -> str:
        return str(self.folder / "server.key")

    def options(self, name: str) -> dict[str, Any]:
        return {"server_public_key": self.server_public, "client_secret_key": self.secret(name)}

    def config(self) -> dict[str, Any]:
        return {
            "auth": "curve",
            "server_secret_key_file": self.secret("server"),
            "client_keys_file": str(self.clients_file),
        }


def start_daemon(workdir: Path, config: dict[str, Any], **client_options: Any) -> Daemon:
    workdir.mkdir(parents=True, exist_ok=True)
    daemon = Daemon(workdir, config)
    daemon.client_options = {"shared_memory": False, **client_options}
    try:
        return daemon.start()
    except BaseException:
        stop(daemon)
        raise


def stop(daemon: Daemon) -> None:
    cleanup = getattr(daemon, "cleanup", None)
    (cleanup or daemon.kill)()


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return Keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def secure(keys: Keys, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon with auth: curve for the module; its own probe uses the admin key."""
    daemon = start_daemon(tmp_path_factory.mktemp("secure"), keys.config(), **keys.options("admin"))
    try:
        yield daemon
    finally:
        stop(daemon)


@pytest.fixture
def as_client(secure: Daemon, keys: Keys) -> Iterator[Callable[..., CacheClient]]:
    opened: list[CacheClient] = []

    def open_client(name: str | None, **kwargs: Any) -> CacheClient:
        options = keys.options(name) if name else {"server_public_key": None, "client_secret_key": None}
        client = secure.client(**{**options, **kwargs})
        opened.append(client)
        return client

    try:
        yield open_client
    finally:
        for client in opened:
            client.close()


def forbidden(call: Callable[[], Any]) -> str:
    with pytest.raises(ServerError) as info:
        call()
    assert info.value.code == ErrorCode.FORBIDDEN, info.value
    return str(info.value)


def metric(daemon: Daemon, name: str, **labels: str) -> float:
    return sample(scrape(daemon.metrics_port), name, **labels) or 0.0


def wait_for_metric(daemon: Daemon, name: str, **labels: str) -> float:
    """The metric once it is above zero (events from libzmq's monitor arrive asynchronously)."""
    deadline = time.monotonic() + 10
    while (value := metric(daemon, name, **labels)) == 0:
        assert time.monotonic() < deadline, f"{name}{labels} stayed 0"
        time.sleep(0.05)
    return value


# -- keys and key files ----------------------------------------------------------------------
def test_keygen_writes_a_private_secret_and_refuses_to_overwrite(tmp_path: Path) -> None:
    out = lmcache_server("keygen", "node", "--dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    public, secret = tmp_path / "node.key", tmp_path / "node.key_secret"
    assert public.stat().st_mode & 0o777 == 0o644
    assert secret.stat().st_mode & 0o777 == 0o600
    pub, sec = read_secret_key(str(secret))
    assert read_public_key(str(public)) == pub == zmq.curve_public(sec)
    assert pub.decode() in out.stdout
    # pyzmq reads the same files (ZeroMQ's certificate format).
    assert zmq.auth.load_certificate(str(secret)) == (pub, sec)
    again = lmcache_server("keygen", "node", "--dir", str(tmp_path))
    assert again.returncode == 2 and "--force" in again.stderr
    assert read_secret_key(str(secret)) == (pub, sec)  # untouched
    assert lmcache_server("keygen", "node", "--dir", str(tmp_path), "--force").returncode == 0
    assert read_secret_key(str(secret)) != (pub, sec)


def test_secret_key_files_readable_by_others_are_refused(tmp_path: Path) -> None:
    _, secret = write_keypair(tmp_path, "c")
    check_private_file(secret)
    secret.chmod(0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        read_secret_key(str(secret))
    with pytest.raises(KeyFileError, match="chmod 600"):
        CacheClient("tcp://127.0.0.1:1", server_public_key=str(tmp_path / "c.key"), client_secret_key=str(secret))
    with pytest.raises(KeyFileError, match="both"):
        CacheClient("tcp://127.0.0.1:1", server_public_key=str(tmp_path / "c.key"))


def test_daemon_refuses_a_group_readable_secret_key(keys: Keys, tmp_path: Path) -> None:
    _, secret = write_keypair(tmp_path, "server")
    secret.chmod(0o640)
    config = {**keys.config(), "server_secret_key_file": str(secret)}
    daemon = Daemon(tmp_path, config)
    daemon.config_path.write_text(yaml.safe_dump(daemon.config))
    out = lmcache_server("--config", str(daemon.config_path))
    stop(daemon)
    assert out.returncode == 2, out.stderr
    assert "server_secret_key_file" in out.stderr and "chmod 600" in out.stderr


def test_auth_curve_needs_both_key_files() -> None:
    with pytest.raises(ConfigError, match="server_secret_key_file"):
        load_config(environ={}, overrides={"auth": "curve", "client_keys_file": "/x"})
    with pytest.raises(ConfigError, match="client_keys_file"):
        load_config(environ={}, overrides={"auth": "curve", "server_secret_key_file": "/x"})


@pytest.mark.parametrize(
    "clients, expected",
    [
        ({"clients": {}}, "at least one client"),
        ({"clients": {"x": {"public_key": "not-a-key"}}}, "valid public_key"),
        ({"clients": {"x": {"public_key": "K", "grants": [{"tenant": "a", "access": "rwx"}]}}}, "access: ro | rw"),
        ({"clients": {"x": {"public_key": "K", "role": "admin"}}}, "public_key, grants, admin"),
        ({"client": {}}, "one key, clients"),
    ],
)
def test_bad_client_keys_files_are_refused(tmp_path: Path, clients: dict[str, Any], expected: str) -> None:
    from lmcache_server.security import load_client_keys

    public, _ = write_keypair(tmp_path, "k")
    text = yaml.safe_dump(clients).replace("public_key: K", f"public_key: {public}")
    path = tmp_path / "clients.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=expected):
        load_client_keys(str(path))


def test_client_keys_file_writable_by_others_is_refused(keys: Keys, tmp_path: Path) -> None:
    from lmcache_server.security import load_client_keys

    path = tmp_path / "clients.yaml"
    text = keys.clients_file.read_text()
    for name in Keys.NAMES:  # relative key paths are resolved against the file's folder
        text = text.replace(f" {name}.key", f" {keys.folder / name}.key")
    path.write_text(text)
    path.chmod(0o600)
    load_client_keys(str(path)).by_name["tenant-a"]
    path.chmod(0o666)
    with pytest.raises(ConfigError, match="go-w"):
        load_client_keys(str(path))


# -- exposure: non-loopback endpoints -----------------------------------------------------------
def test_non_loopback_bind_without_auth_is_refused(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, {})
    daemon.config["listen"] = [f"tcp://0.0.0.0:{daemon.port}"]
    daemon.config_path.write_text(yaml.safe_dump(daemon.config))
    out = lmcache_server("--config", str(daemon.config_path))
    stop(daemon)
    assert out.returncode == 2, out.stderr
    assert f"tcp://0.0.0.0:{daemon.port}" in out.stderr and "allow_insecure" in out.stderr
    assert "ready" not in out.stderr


def test_non_loopback_bind_with_allow_insecure_starts_and_says_so(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, {"allow_insecure": True})
    daemon.config["listen"] = [f"tcp://0.0.0.0:{daemon.port}", daemon.ipc_address]
    daemon.client_options = {"shared_memory": False}
    try:
        daemon.start()
        with daemon.client() as c:
            assert c.put([key(1)], [b"x" * 100]) == [PutStatus.STORED]
        assert "INSECURE" in daemon.log() and "allow_insecure" in daemon.log()
    finally:
        stop(daemon)


def test_loopback_and_ipc_need_no_flag() -> None:
    from lmcache_server.security import is_loopback_endpoint

    for endpoint in ("tcp://127.0.0.1:1", "tcp://127.8.0.1:1", "tcp://[::1]:1", "tcp://localhost:1", "ipc:///x"):
        assert is_loopback_endpoint(endpoint), endpoint
    for endpoint in ("tcp://0.0.0.0:1", "tcp://*:1", "tcp://[::]:1", "tcp://10.0.0.5:1", "tcp://eth0:1"):
        assert not is_loopback_endpoint(endpoint), endpoint


# -- authentication -----------------------------------------------------------------------------
def test_client_without_keys_is_refused(secure: Daemon, as_client: Callable[..., CacheClient]) -> None:
    plain = as_client(None, timeout_s=REFUSED_TIMEOUT_S)
    with pytest.raises(DaemonUnavailable, match="the daemon requires CURVE"):
        plain.ping()
    with pytest.raises(DaemonUnavailable):
        plain.get([key(1)], namespace=NS_A)
    # Which side sees the mechanism mismatch first is a race: the daemon reports
    # it as a protocol failure, or (the client hung up first) one without detail.
    assert wait_for(
        lambda: sum(metric(secure, "lmcache_handshake_failures_total", reason=r) for r in ("protocol", "other")),
        timeout_s=20,
    )
    assert as_client("tenant-a").ping() > 0  # the daemon keeps serving


def test_unknown_client_key_is_refused(secure: Daemon, as_client: Callable[..., CacheClient]) -> None:
    before = metric(secure, "lmcache_auth_rejections_total")
    stranger = as_client("stranger", timeout_s=REFUSED_TIMEOUT_S)
    with pytest.raises(DaemonUnavailable, match=r"refused this client's CURVE key \(ZAP status 400\)"):
        stranger.exists([key(1)], namespace=NS_A)
    assert metric(secure, "lmcache_auth_rejections_total") > before
    assert "refused a CURVE handshake from unknown client key" in secure.log()


def test_wrong_server_key_is_refused(keys: Keys, as_client: Callable[..., CacheClient]) -> None:
    # The client's own key is listed, but it expects another server (a man in the middle would hold that key).
    impostor = str(keys.folder / "stranger.key")
    client = as_client("tenant-a", server_public_key=impostor, timeout_s=REFUSED_TIMEOUT_S)
    with pytest.raises(DaemonUnavailable, match="is server_public_key the daemon's public key"):
        client.ping()


def test_async_client_says_why_and_plain_daemon_names_the_mismatch(keys: Keys, secure: Daemon, daemon: Daemon) -> None:
    async def refused() -> str:
        async with AsyncCacheClient(
            secure.address, NS_A, timeout_s=REFUSED_TIMEOUT_S, fail_open=False, **keys.options("stranger")
        ) as c:
            with pytest.raises(DaemonUnavailable) as err:
                await c.ping()
            return str(err.value)

    assert "refused this client's CURVE key" in asyncio.run(refused())
    # CURVE keys against a daemon without auth: the client names the mismatch.
    with daemon.client(timeout_s=REFUSED_TIMEOUT_S, shared_memory=False, **keys.options("tenant-a")) as c:
        with pytest.raises(DaemonUnavailable, match="the daemon does not use CURVE"):
            c.ping()
    with daemon.client() as plain:
        assert plain.ping() > 0


def test_sighup_reloads_client_keys(keys: Keys, tmp_path: Path) -> None:
    clients = yaml.safe_load(keys.clients_file.read_text())["clients"]
    for entry in clients.values():  # key file paths relative to the keys folder, from a file elsewhere
        if entry["public_key"].endswith(".key"):
            entry["public_key"] = str(keys.folder / entry["public_key"])
    clients_file = tmp_path / "clients.yaml"
    clients_file.write_text(yaml.safe_dump({"clients": clients}))
    clients_file.chmod(0o644)
    config = {**keys.config(), "client_keys_file": str(clients_file)}
    daemon = start_daemon(tmp_path / "d", config, **keys.options("admin"))
    try:
        tenant_a = daemon.client(**keys.options("tenant-a"), namespace=NS_A)
        assert tenant_a.put([key(1)], [b"a" * 100]) == [PutStatus.STORED]
        with daemon.client(**keys.options("stranger"), timeout_s=REFUSED_TIMEOUT_S) as stranger:
            with pytest.raises(DaemonUnavailable, match="refused this client's CURVE key"):
                stranger.ping()

        # Add the stranger with read access to tenant a, drop tenant-a: no restart.
        read_a = [{"tenant": "a", "access": "ro"}]
        clients["stranger"] = {"public_key": str(keys.folder / "stranger.key"), "grants": read_a}
        del clients["tenant-a"]
        clients_file.write_text(yaml.safe_dump({"clients": clients}))
        daemon.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: metric(daemon, "lmcache_client_keys_reloads_total", result="ok") == 1)
        assert "added: stranger; removed: tenant-a" in daemon.log()
        with daemon.client(**keys.options("stranger"), namespace=NS_A) as stranger:
            assert stranger.get([key(1)]) == [b"a" * 100]
            forbidden(lambda: stranger.put([key(2)], [b"x" * 100]))
        forbidden(lambda: tenant_a.get([key(1)]))  # its open connection is refused from now on
        tenant_a.close()

        # A broken file changes nothing.
        clients_file.write_text("clients: [not, a, mapping]\n")
        daemon.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: metric(daemon, "lmcache_client_keys_reloads_total", result="error") == 1)
        assert "client keys not reloaded, the previous ones stay in force" in daemon.log()
        with daemon.client(**keys.options("stranger"), namespace=NS_A) as stranger:
            assert stranger.get([key(1)]) == [b"a" * 100]
        assert daemon.proc.poll() is None
    finally:
        stop(daemon)


# -- tenants ------------------------------------------------------------------------------------
def test_tenants_cannot_touch_each_others_chunks(secure: Daemon, as_client: Callable[..., CacheClient]) -> None:
    a, b = as_client("tenant-a", namespace=NS_A), as_client("tenant-b", namespace=NS_B)
    stored, never = key(10), key(11)
    assert a.put([stored], [b"a-secret" * 100]) == [PutStatus.STORED]
    assert b.put([stored], [b"b-data" * 100]) == [PutStatus.STORED]  # its own namespace
    before = metric(secure, "lmcache_forbidden_requests_total", client="tenant-b")

    messages = set()
    for k in (stored, never):  # a stored and a never-stored key get the same answer
        messages.add(forbidden(lambda k=k: b.get([k], namespace=NS_A)))  # type: ignore[misc]
        messages.add(forbidden(lambda k=k: b.lookup([k], namespace=NS_A)))  # type: ignore[misc]
        messages.add(forbidden(lambda k=k: b.exists([k], namespace=NS_A)))  # type: ignore[misc]
    assert len(messages) == 1 and "may not read namespace" in messages.pop()  # get/lookup/exists alike
    forbidden(lambda: b.put([stored], [b"poison" * 100], namespace=NS_A))
    forbidden(lambda: b.delete([stored], namespace=NS_A))
    forbidden(lambda: b.pin([stored], namespace=NS_A))
    forbidden(lambda: b.unpin([stored], namespace=NS_A))
    forbidden(lambda: b.clear(namespace=NS_A))
    forbidden(lambda: b.stats(namespace=NS_A))
    # A namespace that merely mentions the tenant elsewhere is not the tenant's.
    forbidden(lambda: b.get([stored], namespace=NS_A + "|tenant=b|x"))
    forbidden(lambda: a.get([stored], namespace="tenant=a|" + NS_B))
    assert metric(secure, "lmcache_forbidden_requests_total", client="tenant-b") - before == 13

    got = a.get([stored])[0]
    assert got is not None and bytes(got) == b"a-secret" * 100  # untouched
    assert bytes(b.get([stored])[0]) == b"b-data" * 100
    own = a.stats(namespace=NS_A)
    assert own["namespace"]["chunks"] >= 1
    # Nothing daemon-wide for a tenant key: no tier totals, lookups, quotas of other tenants, pool.
    assert own["scope"] == "namespace" and set(own) == {"namespace", "server", "scope"}
    assert set(own["server"]) == {"version", "chunk_size"}
    assert "tiers" in as_client("admin").stats(namespace=NS_A)  # an admin key sees them


def test_read_only_key_reads_but_cannot_write(as_client: Callable[..., CacheClient]) -> None:
    a, reader = as_client("tenant-a", namespace=NS_A), as_client("reader-a", namespace=NS_A)
    a.put([key(20)], [b"r" * 100])
    assert bytes(reader.get([key(20)])[0]) == b"r" * 100
    assert reader.lookup([key(20), key(21)]).hit_chunks == 1
    assert reader.exists([key(20)]) == [True]
    assert "may not write" in forbidden(lambda: reader.put([key(21)], [b"w" * 100]))
    forbidden(lambda: reader.delete([key(20)]))
    forbidden(lambda: reader.clear())
    forbidden(lambda: reader.pin([key(20)]))
    assert a.exists([key(20), key(21)]) == [True, False]


def test_prefix_grants(as_client: Callable[..., CacheClient]) -> None:
    writer, reader = as_client("tenant-b", namespace=NS_SHARED), as_client("shared-ro", namespace=NS_SHARED)
    assert writer.put([key(30)], [b"s" * 100]) == [PutStatus.STORED]
    assert bytes(reader.get([key(30)])[0]) == b"s" * 100
    forbidden(lambda: reader.put([key(31)], [b"s" * 100]))
    forbidden(lambda: reader.get([key(30)], namespace=NS_B))


def test_shared_memory_path_keeps_the_grants(as_client: Callable[..., CacheClient]) -> None:
    """Same-host clients of a CURVE daemon move chunk bytes through the mapped pool;
    alloc (the shared-memory put) is checked like put."""
    a = as_client("tenant-a", namespace=NS_A, shared_memory=True)
    reader = as_client("reader-a", namespace=NS_A, shared_memory=True)
    data = os.urandom(MiB)
    assert a.put([key(80)], [data]) == [PutStatus.STORED]
    assert bytes(reader.get([key(80)])[0]) == data
    forbidden(lambda: reader.put([key(81)], [data]))
    forbidden(lambda: a.get([key(80)], namespace=NS_B))
    shm = as_client("admin").stats(namespace=NS_A).get("shm") or {}
    if shm.get("enabled"):  # where /dev/shm can hold the pool
        assert shm["committed_bytes"] >= MiB and shm["read_bytes"] >= MiB


def test_global_ops_need_the_admin_role(as_client: Callable[..., CacheClient]) -> None:
    a, admin = as_client("tenant-a", namespace=NS_A), as_client("admin")
    a.put([key(40)], [b"x" * 100])
    assert "admin role" in forbidden(lambda: a.clear(all_namespaces=True))
    assert "admin role" in forbidden(lambda: a.stats())
    assert a.hello()["protocol_version"] == 1 and a.ping() > 0  # open to every key
    stats = admin.stats()
    assert NS_A in stats["namespaces"]
    assert admin.get([key(40)], namespace=NS_A)[0] is not None  # admin may read every namespace
    assert admin.clear(all_namespaces=True) >= 1
    assert a.exists([key(40)]) == [False]


def test_admin_cli_with_keys(secure: Daemon, keys: Keys, as_client: Callable[..., CacheClient]) -> None:
    as_client("tenant-a", namespace=NS_A).put([key(50)], [b"x" * 100])
    base = ["admin", "namespaces", "--address", secure.address, "--server-public-key", keys.server_public]
    out = lmcache_server(*base, "--client-secret-key", keys.secret("admin"))
    assert out.returncode == 0, out.stderr
    assert NS_A in out.stdout
    out = lmcache_server(*base, "--client-secret-key", keys.secret("tenant-a"))
    assert out.returncode == 1 and "FORBIDDEN" in out.stderr
    out = lmcache_server("admin", "ping", "--config", str(secure.config_path), "--timeout", "1")
    assert out.returncode == 1 and "--client-secret-key" in out.stderr
    # The server key from the daemon's config (the .key beside server_secret_key_file).
    out = lmcache_server(
        "admin", "clear", "--all", "--yes", "--config", str(secure.config_path),
        "--client-secret-key", keys.secret("admin"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "removed" in out.stdout


# -- input and per-client limits ----------------------------------------------------------------
def raw_request(sock: zmq.Socket[Any], header: dict[str, Any], *payloads: bytes) -> dict[str, Any]:
    sock.send_multipart([msgpack.packb(header, use_bin_type=True), *payloads])
    assert sock.poll(10_000), "no reply"
    header = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
    assert isinstance(header, dict)
    return header


def test_each_limit_violation_is_counted_and_the_daemon_keeps_serving(daemon_factory: Any) -> None:
    daemon = daemon_factory(max_keys_per_request=4, max_message_size="64KiB")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.address)
    try:
        hdr = {"v": 1, "id": 7, "ns": NAMESPACE}
        cases = [
            # too many frames: dropped as they arrive, answered TOO_LARGE with the id
            ("frames", ErrorCode.TOO_LARGE, {**hdr, "op": "put", "keys": [key(1)]}, [b""] * 10_000),
            ("keys", ErrorCode.TOO_MANY_KEYS, {**hdr, "op": "get", "keys": [key(i) for i in range(5)]}, []),
            ("header_bytes", ErrorCode.TOO_LARGE, {**hdr, "op": "ping", "pad": "x" * 100_000}, []),
            ("message_bytes", ErrorCode.TOO_LARGE, {**hdr, "op": "put", "keys": [key(1)]}, [b"m" * 70_000]),
        ]
        for limit, code, header, payloads in cases:
            reply = raw_request(sock, header, *payloads)
            assert (reply["ok"], reply["code"], reply["id"]) == (False, int(code), 7), reply
            assert sample(scrape(daemon.metrics_port), "lmcache_limit_violations_total", limit=limit) == 1
        # msgpack nesting deeper than the unpacker's stack: MALFORMED, counted, no crash
        sock.send_multipart([b"\x91" * 50_000 + b"\xc0"])
        assert sock.poll(10_000)
        reply = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
        assert reply["code"] == int(ErrorCode.MALFORMED)
        assert sample(scrape(daemon.metrics_port), "lmcache_limit_violations_total", limit="msgpack") == 1
        assert raw_request(sock, {**hdr, "op": "ping", "id": 8})["ok"] is True
    finally:
        sock.close(0)
    with daemon.client(shared_memory=False) as c:
        assert c.put([key(2)], [b"y" * 100]) == [PutStatus.STORED]
        assert bytes(c.get([key(2)])[0]) == b"y" * 100


def test_greedy_client_gets_busy_for_its_bytes_others_are_served(daemon_factory: Any) -> None:
    daemon = daemon_factory(max_local_cpu_size="64MiB", max_client_inflight_bytes="1MiB")
    big, small = [os.urandom(KEY_BYTES) for _ in range(2)], [os.urandom(KEY_BYTES)]
    with daemon.client(shared_memory=False) as c:
        for k in big:
            c.put([k], [os.urandom(4 * MiB)])
        c.put(small, [b"s" * MiB])
        # A greedy reader asks for 8 MiB and does not read its replies: it holds
        # them in flight, past its 1 MiB share (the server budget is 1 GiB).  A raw
        # ZMTP socket: a pyzmq one's I/O thread would drain the reply regardless, and
        # the 8 MiB then left the server's accounting in a race with the next check.
        greedy = RawDealer(daemon.address)
        try:
            greedy.send([msgpack.packb({"v": 1, "op": "get", "id": 1, "ns": NAMESPACE, "keys": big})])
            deadline = time.monotonic() + 10
            while c.stats()["server"]["inflight_bytes"] < 8 * MiB:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            greedy.send([msgpack.packb({"v": 1, "op": "get", "id": 2, "ns": NAMESPACE, "keys": small})])
            time.sleep(0.2)  # the daemon reads the second request while the first reply waits
            assert c.stats()["server"]["inflight_bytes"] >= 8 * MiB, "the greedy client's reply was sent meanwhile"
            assert bytes(c.get(small)[0]) == b"s" * MiB  # another client is served
            replies = {}
            for _ in range(2):
                frames = greedy.recv()
                header = msgpack.unpackb(frames[0], raw=False)
                replies[header["id"]] = header
            assert replies[1]["ok"] is True
            assert (replies[2]["ok"], replies[2]["code"]) == (False, int(ErrorCode.BUSY))
            assert "client_bytes" in replies[2]["message"]
        finally:
            greedy.close()
    text = scrape(daemon.metrics_port)
    assert sample(text, "lmcache_limit_violations_total", limit="client_bytes") == 1


def test_a_key_cannot_multiply_its_share_with_connections(keys: Keys, tmp_path: Path, redis_server: Any) -> None:
    # Gets that miss memory wait for Redis; a paused Redis keeps them in flight.
    config = {**keys.config(), "remote_url": redis_server.url, "remote_timeout_s": 60, "max_key_inflight_requests": 2}
    daemon = start_daemon(tmp_path / "d", config, **keys.options("admin"))
    greedy = zmq.Context.instance().socket(zmq.DEALER)
    greedy.setsockopt(zmq.LINGER, 0)
    CurveKeys.from_options(keys.server_public, keys.secret("tenant-a")).apply(greedy)  # type: ignore[union-attr]
    greedy.connect(daemon.address)
    try:
        with daemon.client(**keys.options("tenant-a"), namespace=NS_A) as a:
            a.put([key(92)], [b"s" * 100])
            assert a.ping() > 0 and _send_and_wait(greedy, {"op": "ping", "id": 0})["ok"]
            pause = subprocess.run(
                ["redis-cli", "-p", str(redis_server.port), "client", "pause", "3000", "all"],
                capture_output=True, text=True, timeout=10,
            )  # fmt: skip
            assert pause.stdout.strip() == "OK", pause
            # One connection of tenant-a fills the key's share with two gets waiting for Redis ...
            for i in (1, 2):
                greedy.send(msgpack.packb({"v": 1, "op": "get", "id": i, "ns": NS_A, "keys": [key(70 + i)]}))
            with daemon.client() as admin:
                wait_for(lambda: _tier_misses(admin) >= 2)
            # ... so another connection of the same key is refused at once; another key is served.
            with pytest.raises(ServerError) as err:
                a.get([key(92)])
            assert err.value.code == ErrorCode.BUSY and "this client key's" in str(err.value)
            assert "key_requests" in str(err.value)
            with daemon.client(**keys.options("reader-a"), namespace=NS_A) as reader:
                assert bytes(reader.get([key(92)])[0]) == b"s" * 100
            for _ in range(2):
                assert greedy.poll(30_000)
                assert msgpack.unpackb(greedy.recv_multipart()[0], raw=False)["ok"] is True
            assert bytes(a.get([key(92)])[0]) == b"s" * 100  # the share is free again
        assert metric(daemon, "lmcache_limit_violations_total", limit="key_requests") == 1
    finally:
        greedy.close(0)
        stop(daemon)


def _send_and_wait(sock: Any, header: dict[str, Any]) -> dict[str, Any]:
    sock.send(msgpack.packb({"v": 1, **header}))
    assert sock.poll(10_000)
    reply: dict[str, Any] = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
    return reply


def _tier_misses(admin: CacheClient) -> int:
    """Memory-tier misses so far: a get that missed memory is on its way to Redis."""
    return int(admin.stats()["tiers"]["memory"]["misses"])


def test_key_limits_need_curve() -> None:
    with pytest.raises(ConfigError, match="max_key_inflight_bytes"):
        load_config(environ={}, overrides={"max_key_inflight_bytes": "1GiB"})


def test_greedy_client_gets_busy_for_its_requests_others_are_served(daemon_factory: Any, redis_server: Any) -> None:
    # Gets that miss memory wait for Redis; a paused Redis keeps them in flight.
    daemon = daemon_factory(remote_url=redis_server.url, remote_timeout_s=60, max_client_inflight_requests=2)
    with daemon.client(shared_memory=False) as polite:
        polite.put([key(60)], [b"p" * 100])
        polite.exists([key(60)])
        greedy = zmq.Context.instance().socket(zmq.DEALER)
        greedy.setsockopt(zmq.LINGER, 0)
        greedy.connect(daemon.address)
        try:
            pause = subprocess.run(
                ["redis-cli", "-p", str(redis_server.port), "client", "pause", "3000", "all"],
                capture_output=True, text=True, timeout=10,
            )  # fmt: skip
            assert pause.stdout.strip() == "OK", pause
            for i in range(3):
                greedy.send(msgpack.packb({"v": 1, "op": "get", "id": i, "ns": NAMESPACE, "keys": [key(70 + i)]}))
            assert greedy.poll(10_000)
            first = msgpack.unpackb(greedy.recv_multipart()[0], raw=False)
            # The third request is refused at once; the first two wait for Redis.
            assert (first["id"], first["code"]) == (2, int(ErrorCode.BUSY)), first
            assert "client_requests" in first["message"]
            assert polite.ping() > 0
            assert bytes(polite.get([key(60)])[0]) == b"p" * 100
            for _ in range(2):
                assert greedy.poll(30_000)
                reply = msgpack.unpackb(greedy.recv_multipart()[0], raw=False)
                assert reply["ok"] is True and reply["found"] == [False]
        finally:
            greedy.close(0)
    assert sample(scrape(daemon.metrics_port), "lmcache_limit_violations_total", limit="client_requests") == 1


def test_client_ledger() -> None:
    ledger = ClientLedger(max_requests=2, max_bytes=10)
    assert ledger.try_acquire(b"a", 50) is None  # an idle client: any size
    assert ledger.try_acquire(b"a", 1) == "client_bytes"
    assert ledger.try_acquire(b"b", 5) is None  # another client is not affected
    ledger.release(b"a", 50)
    assert ledger.try_acquire(b"a", 4) is None and ledger.try_acquire(b"a", 4) is None
    assert ledger.try_acquire(b"a", 0) == "client_requests"
    ledger.release(b"a", 4)
    ledger.hold(b"a", 6)  # an unsent reply
    assert ledger.try_acquire(b"a", 0) == "client_bytes"  # 4 + 6 held: a get would add more
    ledger.release(b"a", 4)
    ledger.unhold(b"a", 6)
    ledger.release(b"b", 5)
    assert len(ledger) == 0


# -- deployment ---------------------------------------------------------------------------------
def test_compose_curve_override_is_valid_and_wired() -> None:
    import json
    import shutil

    from lmcache_client.integrations.vllm.settings import ConnectorSettings

    repo = Path(__file__).resolve().parents[2]
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.fail("docker-compose is not installed; run `make system-deps`")
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "HF_TOKEN")}
    files = ["-f", "docker-compose.yml", "-f", "deploy/compose.curve.yml"]
    out = subprocess.run([compose, *files, "config", "-q"], capture_output=True, text=True, cwd=repo, env=env)
    assert out.returncode == 0 and out.stderr.strip() == "", out.stderr
    merged = yaml.safe_load(
        subprocess.run([compose, *files, "config"], capture_output=True, text=True, cwd=repo, env=env).stdout
    )
    server = merged["services"]["lmcache-server"]
    environ = {k: str(v) for k, v in server["environment"].items()}
    config = load_config(str(repo / "deploy" / "server.docker.yaml"), environ=environ)
    assert config.auth == "curve" and config.listen == ("tcp://0.0.0.0:65432",)
    assert config.server_secret_key_file == "/keys/server.key_secret"
    assert config.client_keys_file == "/keys/clients.yaml"
    for name in ("vllm-a", "vllm-b"):
        command = merged["services"][name]["command"]
        extra = json.loads(command[command.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
        settings = ConnectorSettings.from_extra_config(extra)
        assert settings.client_secret_key == "/keys/vllm.key_secret" and settings.tenant == "compose"
        assert any(v.startswith("lmcache-keys:/keys") for v in map(str, merged["services"][name]["volumes"]))
    # The clients file the key service writes grants the vLLM key tenant "compose" (its namespaces).
    script = merged["services"]["lmcache-keys"]["command"][0]
    assert "{tenant: compose, access: rw}" in script and "admin: true" in script


def test_without_auth_config_changes_nothing(daemon: Daemon) -> None:
    """auth: none (the default): every op works for any client, as before."""
    with daemon.client(shared_memory=False) as c:
        assert c.put([key(90)], [b"z" * 100], namespace=NS_A) == [PutStatus.STORED]
        assert c.exists([key(90)], namespace=NS_A) == [True]
        assert NS_A in c.stats()["namespaces"]
        assert c.clear(all_namespaces=True) >= 1
