"""client/pyproject.toml says ``requires-python = ">=3.10"``: the client on a real
Python 3.10, against a real daemon (which itself needs 3.11 and runs on the suite's
interpreter).

The 3.10 interpreter is ``$LMCACHE_TEST_PYTHON310``, else ``python3.10`` on PATH,
else a pyenv 3.10; it gets a throw-away venv with the client's two dependencies
(pyzmq, msgpack) and imports the client from the source tree.  With no 3.10 on
the machine the test is skipped, except in CI (``CI=true``), where that is a failure.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..conftest import NAMESPACE, Daemon

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import asyncio, os, pathlib, sys
assert sys.version_info[:2] == (3, 10), sys.version
# Every module of the package compiles on 3.10 (the adapters need torch to import);
# compile() writes no .pyc into the source tree.
for path in sorted(pathlib.Path(sys.argv[3]).rglob("*.py")):
    compile(path.read_text(), str(path), "exec")
from lmcache_client import AsyncCacheClient, CacheClient, DaemonUnavailable, PutStatus

address, namespace = sys.argv[1], sys.argv[2]
keys = [os.urandom(32) for _ in range(3)]
data = [os.urandom(100_000) for _ in keys]

with CacheClient(address, namespace, fail_open=False, timeout_s=10) as c:
    assert c.put(keys[:1], data[:1]) == [PutStatus.STORED]


async def main():
    async with AsyncCacheClient(address, namespace, fail_open=False, timeout_s=10) as c:
        assert await c.put(keys[1:], data[1:]) == [PutStatus.STORED] * 2
        assert [bytes(g) for g in await c.get(keys)] == data
        assert (await c.lookup(keys)).hit_chunks == 3
    # Timeouts: a daemon that never answers (nothing listens on this endpoint).
    dead = "ipc://" + os.path.join(sys.argv[4], "nobody.sock")
    async with AsyncCacheClient(dead, namespace, fail_open=True, timeout_s=0.2) as c:
        assert await c.get(keys) == [None] * 3
    async with AsyncCacheClient(dead, namespace, fail_open=False, timeout_s=0.2) as c:
        try:
            await c.ping()
        except DaemonUnavailable:
            pass
        else:
            raise AssertionError("no DaemonUnavailable")


asyncio.run(main())
print("py310 ok")
"""


def _python310() -> str | None:
    candidates = [os.environ.get("LMCACHE_TEST_PYTHON310"), shutil.which("python3.10")]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10*/bin/python3.10")))
    for candidate in candidates:
        if not candidate or not os.access(candidate, os.X_OK):
            continue
        try:  # a pyenv shim may be on PATH without a 3.10 behind it
            probe = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 10))"],
                                   capture_output=True, text=True, timeout=30)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.stdout.strip() == "True":
            return candidate
    return None


@pytest.fixture(scope="module")
def python310(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    base = _python310()
    if base is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no Python 3.10 found (set LMCACHE_TEST_PYTHON310): the client's 3.10 claim is untested")
        pytest.skip("no Python 3.10 on this machine (set LMCACHE_TEST_PYTHON310)")
    venv = tmp_path_factory.mktemp("py310") / "venv"
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    deps = subprocess.run(
        [python, "-m", "pip", "install", "-q", "pyzmq>=25", "msgpack>=1.0"], capture_output=True, text=True, timeout=300
    )
    if deps.returncode != 0:
        pytest.fail(f"cannot install the client's dependencies on 3.10:\n{deps.stderr[-2000:]}")
    yield python


@pytest.mark.timeout(600)
def test_client_runs_on_python_310(python310: str, daemon: Daemon, tmp_path: Path) -> None:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO / "client")}
    out = subprocess.run(
        [python310, "-c", SCRIPT, daemon.address, NAMESPACE, str(REPO / "client" / "lmcache_client"), str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert out.returncode == 0 and "py310 ok" in out.stdout, out.stdout + out.stderr
    assert sys.version_info >= (3, 11)  # the daemon side ran on the suite's interpreter
