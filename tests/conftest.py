"""Fixtures: the real daemon process on free ports, real clients, real sockets.

``daemon_factory(**config)`` starts ``python -m lmcache_server`` with the given
config keys (as ``--set key=value``) on a free TCP port and an ipc socket in the
test's temp dir, waits until it answers ping, and kills it at teardown even
when the test failed.  ``daemon`` is one started with defaults (64 MiB pool).
Test daemons start with ``warm_restart`` off (a restart empties the memory
tier, as the tests of other tiers expect); tests/storage/memory/test_warm_restart.py turns it on.

In-process stores and tiers run on ``runner`` (the test's event loop) and are closed
by ``closed_at_end`` at teardown, so a failed assert never leaks one.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest
import yaml

from lmcache_client import CacheClient, DaemonUnavailable

NAMESPACE = "test-model|float16|L2|KV2|D64|tp0of1|c16"
SHM_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else None


def wait_for(predicate: Callable[[], Any], timeout_s: float = 20.0) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (result := predicate()):
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)
    return result


def disk_stats(c: CacheClient) -> dict[str, Any]:
    """The disk tier's ``stats``."""
    return dict(c.stats()["tiers"]["disk"])


def chunk_files(root: Path) -> list[Path]:
    """The disk tier's chunk records under ``root``."""
    return sorted(root.glob("v1/*/*.chunk"))


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free port this test process has not handed out before.

    The kernel may give the same ephemeral port to two ``bind(0)`` calls in a row once the
    first socket is closed, so a daemon's ZeroMQ and metrics ports could be one port (seen
    in CI: the daemon refused to start, its metrics port in use).
    """
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free port left that this test process has not handed out")


class Daemon:
    """One daemon process; ``address`` is its TCP endpoint, ``ipc_address`` its ipc one."""

    def __init__(
        self,
        workdir: Path,
        config: dict[str, Any],
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
        port: int | None = None,
    ):
        self.workdir = workdir
        self.port = port or free_port()
        self.metrics_port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.ipc_address = f"ipc://{workdir}/lmcache.sock"
        # Each daemon's shared-memory pool segment lives in its own directory on
        # the tmpfs, removed at teardown (segments of killed daemons included).
        self.shm_dir = Path(tempfile.mkdtemp(prefix="lmcache-test-", dir=SHM_ROOT))
        self.config = {
            "listen": [self.address, self.ipc_address],
            "metrics_port": self.metrics_port,
            "max_local_cpu_size": "64MiB",
            "drain_timeout_s": 5,
            "shm_dir": str(self.shm_dir),
            "warm_restart": False,
            **config,
        }
        self.config_path = workdir / "server.yaml"
        self.log_path = workdir / "daemon.log"
        self.env = env
        self.prefix = prefix or []  # e.g. ["prlimit", "--fsize=..."] to run the daemon under limits
        self.proc: subprocess.Popen[bytes] | None = None
        self.client_options: dict[str, Any] = {}  # e.g. CURVE keys, for the probe and client()

    def start(self, timeout_s: float = 20.0) -> Daemon:
        self.config_path.write_text(yaml.safe_dump(self.config))
        env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
        # The per-user default state directory (storage/statefiles.py), per daemon: no test
        # leaves state in the home directory, and a restart of this daemon finds its own.
        env["XDG_STATE_HOME"] = str(self.workdir / "state")
        env.update(self.env or {})
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - held open for the process's lifetime
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "lmcache_server", "--config", str(self.config_path)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + timeout_s
        with CacheClient(self.address, timeout_s=0.5, fail_open=False, **self.client_options) as probe:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    probe.ping(timeout_s=0.5)
                    return self
                except DaemonUnavailable:
                    time.sleep(0.05)
        raise RuntimeError(f"daemon did not answer within {timeout_s}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if hasattr(self, "_log"):
            self._log.close()

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.shm_dir, ignore_errors=True)

    def client(self, **kwargs: Any) -> CacheClient:
        kwargs.setdefault("timeout_s", 10.0)
        kwargs.setdefault("fail_open", False)
        for name, value in self.client_options.items():
            kwargs.setdefault(name, value)
        return CacheClient(kwargs.pop("address", self.address), kwargs.pop("namespace", NAMESPACE), **kwargs)


def _daemons(base: Path) -> Iterator[Callable[..., Daemon]]:
    started: list[Daemon] = []

    def start(
        env: dict[str, str] | None = None, prefix: list[str] | None = None, port: int | None = None, **config: Any
    ) -> Daemon:
        workdir = base / f"daemon{len(started)}"
        workdir.mkdir()
        daemon = Daemon(workdir, config, env, prefix, port)
        started.append(daemon)
        return daemon.start()

    try:
        yield start
    finally:
        for daemon in started:
            daemon.cleanup()


@pytest.fixture(scope="session", autouse=True)
def _private_state_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The per-user default state directory (storage/statefiles.py) of everything this
    test process runs or starts, unless a test names its own: a temp dir, so no test
    leaves state (an installation id, kept events) in the home directory."""
    saved = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state-home"))
    yield
    if saved is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = saved


@pytest.fixture
def runner() -> Iterator[asyncio.Runner]:
    """The test's event loop: ``runner.run(scenario())`` in the test, and the teardown of
    :func:`closed_at_end` on the same loop (a store's tasks and connections live on it)."""
    with asyncio.Runner() as loop:
        yield loop


Part = TypeVar("Part")


class Closer(Protocol):
    """The :func:`closed_at_end` fixture: registers a part, returns it."""

    def __call__(self, part: Part, /) -> Part: ...


@pytest.fixture
def closed_at_end(runner: asyncio.Runner) -> Iterator[Closer]:
    """``closed_at_end(store)`` returns the store (a tier, a proxy: anything with a
    ``close()``, awaited when it is a coroutine) and closes it at teardown, the last
    registered first, on the test's loop: a failed assert never leaks one (its threads,
    its pool, its connections).  Register the store only, not the tiers it owns."""
    parts: list[Any] = []

    def register(part: Part) -> Part:
        parts.append(part)
        return part

    yield register
    failed: list[BaseException] = []
    for part in reversed(parts):
        try:
            closing = part.close()
            if inspect.isawaitable(closing):
                runner.run(closing)
        except Exception as err:  # close the others all the same, then fail the teardown
            failed.append(err)
    if failed:
        raise failed[0]


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Start daemons that live for one test."""
    yield from _daemons(tmp_path)


@pytest.fixture(scope="module")
def module_daemon_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Daemon]]:
    """Start daemons shared by a module's tests (for tests that only need it alive)."""
    yield from _daemons(tmp_path_factory.mktemp("daemons"))


@pytest.fixture
def disk_daemon(daemon_factory: Callable[..., Daemon], tmp_path: Path) -> Any:
    """``start(**config)``: a daemon with an 8 MiB pool and a 64 MiB disk tier in
    ``start.root`` (so most chunks spill); config keys override the defaults."""
    root = tmp_path / "spill"

    def start(**config: Any) -> Daemon:
        config.setdefault("max_local_cpu_size", "8MiB")
        config.setdefault("max_local_disk_size", "64MiB")
        return daemon_factory(local_disk=f"file://{root}", **config)

    start.root = root  # type: ignore[attr-defined]
    return start


@pytest.fixture
def daemon(daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory()


@pytest.fixture
def client(daemon: Daemon) -> Iterator[CacheClient]:
    with daemon.client() as c:
        yield c


# -- Redis ------------------------------------------------------------------------------
class RedisServer:
    """A real redis-server on a free loopback port with its own temp dir."""

    def __init__(self, workdir: Path, *extra: str, port: int | None = None):
        binary = shutil.which("redis-server")
        if binary is None:  # fail loudly: CI installs it (see .ci/run)
            raise RuntimeError("redis-server is not installed; the Redis tests need it")
        self.binary = binary
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.extra = list(extra)
        self.url = f"redis://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--protected-mode", "no", *self.extra]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                assert self.proc.poll() is None, "redis-server exited at start"
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


# -- Mooncake Store -----------------------------------------------------------------------
class MooncakeMaster:
    """A real ``mooncake_master`` (with its built-in HTTP metadata server) on free loopback
    ports, logging into its own temp dir.  ``daemon_config()`` is what a daemon needs to
    use it as its remote tier (a 64 MiB segment of its own)."""

    def __init__(self, workdir: Path):
        binary = Path(sys.executable).with_name("mooncake_master")
        found = str(binary) if binary.exists() else shutil.which("mooncake_master")
        if found is None:  # fail loudly: the test extras install it (pyproject.toml)
            raise RuntimeError(
                "mooncake_master is not installed; the Mooncake tests need mooncake-transfer-engine-non-cuda"
            )
        self.binary = found
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.metadata_port = free_port()
        self.metrics_port = free_port()
        self.url = f"mooncake://127.0.0.1:{self.port}"
        self.metadata_server = f"http://127.0.0.1:{self.metadata_port}/metadata"
        self.log_path = workdir / "master.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> MooncakeMaster:
        args = [self.binary, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.metadata_port}", f"--metrics_port={self.metrics_port}"]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                for port in (self.port, self.metadata_port):
                    with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                        pass
                return self
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"mooncake_master exited at start:\n{self.log()}") from None
                time.sleep(0.05)
        raise RuntimeError(f"mooncake_master did not start:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def daemon_config(self, **overrides: Any) -> dict[str, Any]:
        return {
            "remote_url": self.url,
            "mooncake_metadata_server": self.metadata_server,
            "mooncake_local_hostname": "127.0.0.1",
            "mooncake_segment_size": "64MiB",
            "mooncake_buffer_size": "32MiB",
            **overrides,
        }


@pytest.fixture
def mooncake_master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    master = MooncakeMaster(tmp_path / "mooncake").start()
    try:
        yield master
    finally:
        master.stop()
