"""Issue 29 item 10 and item 13 (durability and minor hardening).

- A request's ``lmcache_load_wait_s`` never exceeds the configured ``load_wait_s``.
- A spill directory serves one daemon: a second one on it refuses to start.
- Redis removals (clear, delete) and writes made while Redis is down survive a
  clean stop of the daemon: the next start sends them (item 10).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from lmcache_client.integrations.vllm.scheduler import SchedulerSide
from lmcache_client.protocol import PutStatus
from lmcache_server.config import load_config
from lmcache_server.daemon import warm_start
from lmcache_server.storage.memory.warmstart import WarmIndex, boot_id, encode

from ..conftest import SHM_ROOT, Daemon, RedisServer, wait_for
from .test_redis_tier import redis_key_of

KEY_BYTES = 32


def _request(params: object) -> object:
    return types.SimpleNamespace(request_id="r1", kv_transfer_params=params)


@pytest.mark.parametrize(
    ("asked", "expected"),
    [(1e9, 3.0), (float("inf"), 3.0), (float("nan"), 3.0), (1.5, 1.5), (-4, 0.0), ("x", 3.0), (None, 3.0)],
)
def test_a_requests_load_wait_is_capped_at_the_configured_load_wait_s(asked: object, expected: float) -> None:
    scheduler = SchedulerSide([], 256, load_wait_s=3.0)
    assert scheduler._wait_s(_request({"lmcache_load_wait_s": asked})) == expected
    assert scheduler._wait_s(_request({})) == 3.0


def test_a_second_daemon_on_the_same_spill_directory_refuses_to_start(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    root = tmp_path / "spill"
    config = {"local_disk": f"file://{root}", "max_local_disk_size": "64MiB"}
    first = daemon_factory(**config)
    with pytest.raises(RuntimeError, match="exited with 2") as err:
        daemon_factory(**config)
    assert str(root) in str(err.value) and "another daemon" in str(err.value)
    # The first one still serves, its spill directory untouched.
    with first.client() as c:
        c.ping()
    assert first.stop() == 0
    # Once it stopped, the directory is free again.
    daemon_factory(**config).stop()


@pytest.fixture
def durable_redis() -> Iterator[RedisServer]:
    """A redis-server that keeps what it acknowledged across a kill (AOF on tmpfs)."""
    workdir = Path(tempfile.mkdtemp(prefix="lmcache-redis-", dir=SHM_ROOT))
    server = RedisServer(workdir, "--appendonly", "yes", "--appendfsync", "always").start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _redis(c: object) -> dict[str, object]:
    return c.stats()["tiers"]["redis"]  # type: ignore[attr-defined, no-any-return]


def _stored_in_redis(daemon: Daemon, redis: RedisServer, keys: list[bytes], payload: bytes) -> None:
    with daemon.client() as c:
        assert c.put(keys, [payload] * len(keys)) == [PutStatus.STORED] * len(keys)
        wait_for(lambda: _redis(c)["queued_writes"] == 0 and _redis(c)["up"])


@pytest.mark.parametrize("removal", ["clear", "delete"])
@pytest.mark.parametrize("with_disk", [False, True], ids=["pending-in-shm_dir", "pending-in-spill-dir"])
def test_a_removal_made_while_redis_is_down_survives_a_daemon_restart(
    daemon_factory: Callable[..., Daemon], durable_redis: RedisServer, tmp_path: Path, removal: str, with_disk: bool
) -> None:
    disk = {"local_disk": f"file://{tmp_path / 'spill'}", "max_local_disk_size": "64MiB"} if with_disk else {}
    daemon = daemon_factory(remote_url=durable_redis.url, remote_timeout_s=0.3, **disk)
    keys = [os.urandom(KEY_BYTES) for _ in range(4)]
    payload = os.urandom(10_000)
    _stored_in_redis(daemon, durable_redis, keys, payload)
    durable_redis.stop()
    with daemon.client() as c:
        if removal == "clear":
            c.clear()
        else:
            c.delete(keys[:2])
        assert c.get(keys[:2]) == [None, None]
    assert daemon.stop() == 0
    durable_redis.start()  # it still holds every key (AOF)
    daemon.start()
    with daemon.client() as c:
        assert c.get(keys[:2]) == [None, None]  # not read back from Redis
        wait_for(lambda: _redis(c)["pending_removals"] == 0 and _redis(c)["up"])
        assert c.get(keys[:2]) == [None, None]
        if removal == "delete":
            assert [bytes(v) for v in c.get(keys[2:])] == [payload, payload]  # the rest stays
    assert "Redis uplink" in daemon.log() and "pending" in daemon.log()


def test_writes_queued_while_redis_is_down_reach_it_after_a_warm_restart(
    daemon_factory: Callable[..., Daemon], durable_redis: RedisServer
) -> None:
    daemon = daemon_factory(remote_url=durable_redis.url, remote_timeout_s=0.3, warm_restart=True)
    durable_redis.stop()
    keys = [os.urandom(KEY_BYTES) for _ in range(3)]
    payload = os.urandom(10_000)
    with daemon.client() as c:
        assert c.put(keys, [payload] * 3) == [PutStatus.STORED] * 3
        wait_for(lambda: _redis(c)["up"] is False)
        assert _redis(c)["queued_writes"] == 3
    assert daemon.stop() == 0
    durable_redis.start()
    daemon.start()
    with daemon.client() as c:
        wait_for(lambda: _redis(c)["queued_writes"] == 0 and _redis(c)["up"], timeout_s=30)
    r = redis.Redis(port=durable_redis.port)
    assert all(r.exists(redis_key_of(k)) for k in keys)
    assert "re-queued 3" in daemon.log()


@pytest.mark.parametrize(("job", "removed"), [("stop", True), ("restart", False), ("", False), (None, False)])
def test_the_systemd_unit_frees_a_kept_pool_segment_on_stop_only(
    tmp_path: Path, job: str | None, removed: bool
) -> None:
    """ExecStopPost, run with a stand-in ``systemctl`` that lists one job of the unit
    (None: systemctl fails), the unit's lmcache-server and config pointed at this tree
    and a config whose shm_dir is a temp dir holding a segment the daemon kept."""
    unit = (Path(__file__).resolve().parents[2] / "deploy" / "lmcache-server.service").read_text()
    [line] = [x for x in unit.splitlines() if x.startswith("ExecStopPost=")]
    command = line.removeprefix("ExecStopPost=").lstrip("-")
    shm = tmp_path / "shm"
    shm.mkdir()
    config_path = tmp_path / "server.yaml"
    config_path.write_text(f"listen: [tcp://127.0.0.1:7001]\nshm_dir: {shm}\nmax_local_cpu_size: 64MiB\n")
    warm = warm_start(load_config(str(config_path), environ={}))
    name = "lmcache-pool-123-" + "ab" * 16
    segment = shm / name
    segment.write_bytes(b"x")
    index = WarmIndex(name, 64 << 20, warm.identity, boot_id(), time.time(), [], [], warm.installation)
    (shm / (name + ".warm")).write_bytes(encode(index))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "systemctl"
    body = "exit 1" if job is None else f"echo '42 lmcache-server.service {job} running'" if job else "true"
    fake.write_text(f"#!/bin/sh\n{body}\n")
    fake.chmod(0o755)
    command = command.replace("%n", "lmcache-server.service").replace("/etc/lmcache/server.yaml", str(config_path))
    command = command.replace("/opt/lmcache-server/bin/lmcache-server", f"{sys.executable} -m lmcache_server")
    argv = shlex.split(command)
    env = {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        "XDG_STATE_HOME": os.environ["XDG_STATE_HOME"],  # the installation id warm_start used above
    }
    out = subprocess.run(argv, env=env, check=False)
    assert out.returncode == 0
    assert segment.exists() is not removed
    assert (shm / (name + ".warm")).exists() is not removed
