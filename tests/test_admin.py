"""The admin CLI (``lmcache-server admin ...``) against the real daemon, as a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lmcache_client.protocol import KEY_BYTES
from lmcache_server.admin import daemon_address, format_stats, metrics_url
from lmcache_server.config import load_config

from .conftest import NAMESPACE, Daemon, free_port

OTHER = "other-model|bfloat16|L4|KV8|D128|tp0of1|c16"


COMMANDS = ("ping", "health", "stats", "namespaces", "clear", "pin", "unpin", "delete", "prefetch", "namespace")
COMMANDS += ("who-has",)


def admin(*args: str, timeout_s: float = 30.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``lmcache-server admin ARGS`` with no LMCACHE_* variable but those of ``env``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "lmcache_server", "admin", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )


@pytest.fixture(scope="module")
def filled(module_daemon_factory: Callable[..., Daemon]) -> Daemon:
    """A daemon with 3 chunks in NAMESPACE and 2 in OTHER; 3 of 4 gets hit."""
    daemon = module_daemon_factory()
    keys = [os.urandom(KEY_BYTES) for _ in range(4)]
    with daemon.client() as c:
        c.put(keys[:3], [b"a" * 4096] * 3)
        c.put(keys[:2], [b"b" * 1000] * 2, namespace=OTHER)
        c.get(keys)
        c.lookup(keys)
    return daemon


def test_ping_finds_the_daemon_from_its_config(filled: Daemon) -> None:
    out = admin("ping", "--config", str(filled.config_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"pong from {filled.address} in ")
    out = admin("ping", "--address", filled.ipc_address, "--json")
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["ok"] is True and reply["address"] == filled.ipc_address and reply["rtt_ms"] > 0


def test_health_checks_ping_version_and_readiness(filled: Daemon) -> None:
    out = admin("health", "--config", str(filled.config_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"healthy: lmcache-server 0.1.0 at {filled.address}")
    assert f"http://127.0.0.1:{filled.metrics_port}/readyz 200" in out.stdout
    out = admin("health", "--config", str(filled.config_path), "--json")
    health = json.loads(out.stdout)
    assert health["ok"] is True and health["ready"] is True and health["tiers"] == ["memory"]
    assert health["protocol_version"] == 1
    # An HTTP endpoint that does not answer means "not ready": exit 1, for probes and scripts.
    out = admin("health", "--address", filled.address, "--metrics-url", f"http://127.0.0.1:{free_port()}")
    assert out.returncode == 1 and out.stdout.startswith("NOT READY"), out
    # With only --address there is no HTTP port to check: the wire check alone decides.
    out = admin("health", "--address", filled.address, "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["ready"] is None


def test_stats_table_and_json(filled: Daemon) -> None:
    out = admin("stats", "--address", filled.address)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"lmcache-server 0.1.0 at {filled.address}, up ")
    header = next(ln for ln in lines if ln.startswith("tier "))
    columns = "tier chunks stored capacity used hits misses hit rate evictions promotions spills queued dropped state"
    assert header.split() == columns.split()
    memory = next(ln for ln in lines if ln.startswith("memory "))
    assert memory.split()[1] == "5"  # chunks in both namespaces
    assert "64.00 MiB" in memory and "75.0%" in memory and memory.endswith("ok")
    assert "chunk reads: 4, served from some tier: 3 (75.0%)" in lines
    assert "lookups: 1, chunks asked 4, leading hits 3 (75.0%)" in lines
    assert "namespaces: 2 (list them with `admin namespaces`)" in lines
    assert (
        "memory policy: adaptive, head rule off (0 switches), eviction order lfuda's (0 switches), "
        "0 chunks not admitted"
    ) in lines

    out = admin("stats", "--address", filled.address, "--json", "--namespace", OTHER)
    stats = json.loads(out.stdout)
    assert stats["tiers"]["memory"]["chunks"] == 5
    assert stats["namespace"] == {
        "name": OTHER,
        "chunks": 2,
        "stored_bytes": 2000,
        "pinned_chunks": 0,
        "pinned_bytes": 0,
    }
    assert f"namespace {OTHER}: chunks 2, pinned_bytes 0, pinned_chunks 0, stored_bytes 2000" in format_stats(
        stats, filled.address
    )
    # What a tenant key gets (auth: curve, no admin role): its namespace only.
    server = {"version": "0.1.0", "chunk_size": 256}
    tenant_view = {"namespace": stats["namespace"], "server": server, "scope": "namespace"}
    report = format_stats(tenant_view, filled.address).splitlines()
    assert report[0] == f"lmcache-server 0.1.0 at {filled.address}, chunk_size 256"
    assert f"namespace {OTHER}: chunks 2, pinned_bytes 0, pinned_chunks 0, stored_bytes 2000" in report
    assert "(daemon-wide figures are shown to admin keys only)" in report and not any("tier" in ln for ln in report)


def test_namespaces(filled: Daemon) -> None:
    out = admin("namespaces", "--address", filled.address)
    assert out.returncode == 0, out.stderr
    rows = {ln.split()[0]: ln.split()[1:] for ln in out.stdout.splitlines()[1:]}
    assert rows[NAMESPACE][:3] == ["3", "12.00", "KiB"] and rows[OTHER][:3] == ["2", "1.95", "KiB"]
    listing = json.loads(admin("namespaces", "--address", filled.address, "--json").stdout)
    assert listing[OTHER] == {"chunks": 2, "stored_bytes": 2000, "pinned_chunks": 0, "pinned_bytes": 0}


def test_clear_a_namespace_and_everything(daemon: Daemon) -> None:
    keys = [os.urandom(KEY_BYTES) for _ in range(3)]
    with daemon.client() as c:
        c.put(keys, [b"x" * 100] * 3)
        c.put(keys[:1], [b"y" * 100], namespace=OTHER)
        out = admin("clear", "--address", daemon.address, "--namespace", OTHER)
        assert out.returncode == 0 and out.stdout.strip() == f"removed 1 chunks from namespace {OTHER}", out
        assert c.exists(keys[:1], namespace=OTHER) == [False]
        assert c.exists(keys) == [True] * 3
        # The whole cache only with --yes.
        out = admin("clear", "--address", daemon.address, "--all")
        assert out.returncode == 2 and "--yes" in out.stderr
        assert c.exists(keys) == [True] * 3
        out = admin("clear", "--address", daemon.address, "--all", "--yes", "--json")
        assert out.returncode == 0 and json.loads(out.stdout)["removed"] == 3
        assert c.exists(keys) == [False] * 3
    # One of --namespace / --all is required.
    assert admin("clear", "--address", daemon.address).returncode == 2


def test_unreachable_daemon_fails_fast_without_traceback() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    started = time.monotonic()
    out = admin("stats", "--address", address, "--timeout", "0.5")
    assert out.returncode == 1
    assert time.monotonic() - started < 10
    assert out.stderr.strip() == f"lmcache-server at {address} (from --address) unavailable: no connection to {address}"
    assert out.stdout == ""


def test_bad_config_is_exit_2(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "bad.yaml"
    path.write_text("listen: [nowhere]\n")
    out = admin("ping", "--config", str(path))
    assert out.returncode == 2 and "config key 'listen'" in out.stderr


def test_addresses_from_wildcard_config() -> None:
    c = load_config(
        environ={}, overrides={"listen": ["tcp://0.0.0.0:7000", "ipc:///run/x.sock"], "metrics_host": "0.0.0.0"}
    )
    assert daemon_address(c) == "tcp://127.0.0.1:7000"
    assert metrics_url(c) == "http://127.0.0.1:9464"
    c = load_config(environ={}, overrides={"listen": ["tcp://[::]:7000"], "metrics_host": "::", "metrics_port": 9000})
    assert daemon_address(c) == "tcp://[::1]:7000" and metrics_url(c) == "http://[::1]:9000"
    c = load_config(environ={}, overrides={"listen": ["ipc:///run/x.sock"], "metrics_port": 0})
    assert daemon_address(c) == "ipc:///run/x.sock" and metrics_url(c) is None


def test_server_command_line_is_unchanged() -> None:
    out = subprocess.run([sys.executable, "-m", "lmcache_server", "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "--config" in out.stdout and "lmcache-server admin" in out.stdout
    assert "lmcache-server admin --help" in " ".join(out.stdout.split())


def test_admin_help_lists_every_command() -> None:
    out = admin("--help")
    assert out.returncode == 0, out.stderr
    listed = {line.split()[0] for line in out.stdout.splitlines() if line.startswith("    ") and line.split()}
    assert set(COMMANDS) <= listed, set(COMMANDS) - listed
    assert "LMCACHE_SERVER_ADDRESS" in out.stdout
    for command in COMMANDS:  # and each command's own help runs
        sub = admin(command, "--help")
        assert sub.returncode == 0 and sub.stdout.startswith(f"usage: lmcache-server admin {command}"), sub


def test_the_address_comes_from_lmcache_server_address(filled: Daemon, tmp_path: Path) -> None:
    """--address > $LMCACHE_SERVER_ADDRESS > --config's listen > the default."""
    dead = f"tcp://127.0.0.1:{free_port()}"
    out = admin("ping", env={"LMCACHE_SERVER_ADDRESS": filled.address})
    assert out.returncode == 0 and out.stdout.startswith(f"pong from {filled.address} in "), out
    out = admin("ping", "--address", filled.address, env={"LMCACHE_SERVER_ADDRESS": dead})
    assert out.returncode == 0 and out.stdout.startswith(f"pong from {filled.address} in "), out
    elsewhere = tmp_path / "elsewhere.yaml"
    elsewhere.write_text(f"listen: [{dead}]\nmetrics_port: {filled.metrics_port}\n")
    out = admin("health", "--config", str(elsewhere), env={"LMCACHE_SERVER_ADDRESS": filled.address})
    assert out.returncode == 0 and out.stdout.startswith(f"healthy: lmcache-server 0.1.0 at {filled.address}"), out
    assert "/readyz 200" in out.stdout  # the config still gives the HTTP endpoint
    assert out.stderr == ""  # no "ignoring LMCACHE_SERVER_ADDRESS: no config key" from the config loader
    out = admin("ping", "--timeout", "0.5", env={"LMCACHE_SERVER_ADDRESS": dead})
    assert out.returncode == 1 and out.stderr.strip() == (
        f"lmcache-server at {dead} (from LMCACHE_SERVER_ADDRESS) unavailable: no connection to {dead}"
    )


@pytest.mark.parametrize("value", ["localhost:65432", "tcp://127.0.0.1", "tcp://127.0.0.1:http", "ipc://"])
def test_a_bad_endpoint_is_one_line_naming_where_it_came_from(value: str) -> None:
    for args, env, source in (((), {"LMCACHE_SERVER_ADDRESS": value}, "LMCACHE_SERVER_ADDRESS"),
                              (("--address", value), {}, "--address")):  # fmt: skip
        out = admin("ping", *args, env=env, timeout_s=20)  # it used to hang in zmq's context.term()
        assert out.returncode == 2, out
        assert out.stderr.strip() == f"{source}: {value!r} is not an endpoint: tcp://HOST:PORT or ipc:///PATH"
