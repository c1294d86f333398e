"""When the pool is kept at a stop (issue 39 item 7), against real daemon processes.

A kept pool segment holds host memory the size of the pool until a later start
adopts it, so it is kept only where a restart is expected: ``warm_restart``
(``lmcache-server --keep-warm``, what the shipped systemd unit, compose files and
DaemonSet pass).  By default a stop releases it, and ``lmcache-server cleanup``
removes what a supervised daemon kept once it stopped for good.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lmcache_client import PutStatus
from lmcache_server.cli import main as cli_main
from lmcache_server.config import load_config
from lmcache_server.daemon import warm_start
from lmcache_server.storage.memory.warmstart import WarmIndex, boot_id, encode

from ...conftest import Daemon

MiB = 1 << 20
KEEP_WARM = ["/bin/sh", "-c", 'exec "$@" --keep-warm', "sh"]
"""A prefix that appends ``--keep-warm`` to the daemon's command line (as a unit's ExecStart would)."""


def key(i: int) -> bytes:
    return hashlib.sha256(f"keep-{i}".encode()).digest()


def value(k: bytes) -> bytes:
    return hashlib.shake_128(k).digest(MiB)


def put_some(d: Daemon, n: int = 4) -> list[bytes]:
    keys = [key(i) for i in range(n)]
    with d.client() as c:
        assert c.put(keys, [value(k) for k in keys]) == [PutStatus.STORED] * n
    return keys


def pool_files(shm_dir: Path) -> list[str]:
    return sorted(p.name for p in shm_dir.iterdir() if p.name.startswith("lmcache-pool-"))


def cleanup(d: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    """``lmcache-server cleanup --config <d's config> ARGS`` as ``d``'s user and state
    directory would run it (the installation id lives there)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    env["XDG_STATE_HOME"] = str(d.workdir / "state")
    args = ("--config", str(d.config_path), *args)
    return subprocess.run(
        [sys.executable, "-m", "lmcache_server", "cleanup", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_the_flag_turns_warm_restart_on_and_the_default_is_off(capsys: object) -> None:
    assert cli_main(["--print-config"]) == 0
    assert "warm_restart: false" in capsys.readouterr().out  # type: ignore[attr-defined]
    assert cli_main(["--keep-warm", "--print-config"]) == 0
    assert "warm_restart: true" in capsys.readouterr().out  # type: ignore[attr-defined]


def test_a_plain_sigint_stop_of_a_default_daemon_leaves_no_segment(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory()
    assert d.stop() == 0
    del d.config["warm_restart"]  # the default config, as `make run` starts it
    d.start()
    put_some(d)
    with d.client() as c:
        assert c.uses_shared_memory
    assert len(pool_files(d.shm_dir)) == 1
    assert d.stop(signal.SIGINT) == 0  # Ctrl-C
    assert pool_files(d.shm_dir) == []
    assert "kept the memory pool" not in d.log()


def test_a_supervised_stop_keeps_the_pool_and_the_next_start_adopts_it(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory(prefix=KEEP_WARM, cache_policy="lru")  # --keep-warm beats the file's warm_restart: false
    keys = put_some(d)
    assert d.stop() == 0  # what systemd, compose and Kubernetes send
    (segment,) = [name for name in pool_files(d.shm_dir) if "." not in name]
    assert pool_files(d.shm_dir) == [segment, segment + ".warm"]
    d.start()
    assert "warm restart: adopted " + segment in d.log()
    with d.client() as c:
        assert c.stats()["tiers"]["memory"]["chunks"] == len(keys)
        assert c.get(keys) == [value(k) for k in keys]  # hits, from the adopted pool
    assert d.stop() == 0


def test_a_start_with_warm_restart_off_removes_what_its_last_stop_kept(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory(warm_restart=True)
    put_some(d)
    assert d.stop() == 0
    (kept,) = [name for name in pool_files(d.shm_dir) if "." not in name]
    d.config["warm_restart"] = False
    d.start()
    assert "warm_restart is off: removed the pool segment " + kept in d.log()
    (live,) = pool_files(d.shm_dir)
    assert live != kept
    with d.client() as c:
        assert c.stats()["tiers"]["memory"]["chunks"] == 0
    assert d.stop() == 0
    assert pool_files(d.shm_dir) == []


@pytest.mark.parametrize("all_daemons", [False, True])
def test_cleanup_removes_a_kept_segment_and_leaves_live_ones(
    daemon_factory: Callable[..., Daemon], all_daemons: bool
) -> None:
    stopped = daemon_factory(warm_restart=True)
    put_some(stopped)
    assert stopped.stop() == 0
    (kept,) = [name for name in pool_files(stopped.shm_dir) if "." not in name]
    # Another daemon, running, on the same shm_dir: its segment is live (locked, no index).
    running = daemon_factory(shm_dir=str(stopped.shm_dir), warm_restart=True)
    keys = put_some(running)
    (live,) = [name for name in pool_files(stopped.shm_dir) if name not in (kept, kept + ".warm")]
    # A daemon holding the kept segment's lock (one stopping, or adopting it): left alone.
    fd = os.open(stopped.shm_dir / kept, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        out = cleanup(stopped)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"left {kept}" in out.stdout and "in use by a running daemon" in out.stdout
        assert pool_files(stopped.shm_dir) == sorted([kept, kept + ".warm", live])
    finally:
        os.close(fd)
    # The running daemon's own config: its segment is live, the other daemon's kept one not its own.
    out = cleanup(running)
    assert out.returncode == 0 and "nothing to remove" in out.stdout, out.stdout + out.stderr
    assert pool_files(stopped.shm_dir) == sorted([kept, kept + ".warm", live])
    if all_daemons:  # every daemon's kept segments in that shm_dir, from any config naming it
        out = cleanup(running, "--all")
    else:
        out = cleanup(stopped)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"removed {kept} (" in out.stdout and "and its index" in out.stdout
    assert pool_files(stopped.shm_dir) == [live]
    out = cleanup(stopped)
    assert out.returncode == 0 and "nothing to remove" in out.stdout, out.stdout + out.stderr
    with running.client() as c:
        assert c.get(keys) == [value(k) for k in keys]
    # A start of the stopped daemon is cold now (nothing kept to adopt).
    stopped.start()
    with stopped.client() as c:
        assert c.stats()["tiers"]["memory"]["chunks"] == 0


# -- the shipped systemd unit frees a kept segment on stop only ---------------------------
@pytest.mark.parametrize(("job", "removed"), [("stop", True), ("restart", False), ("", False), (None, False)])
def test_the_systemd_unit_frees_a_kept_pool_segment_on_stop_only(
    tmp_path: Path, job: str | None, removed: bool
) -> None:
    """ExecStopPost, run with a stand-in ``systemctl`` that lists one job of the unit
    (None: systemctl fails), the unit's lmcache-server and config pointed at this tree
    and a config whose shm_dir is a temp dir holding a segment the daemon kept."""
    unit = (Path(__file__).resolve().parents[3] / "deploy" / "lmcache-server.service").read_text()
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
