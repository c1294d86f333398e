"""The warm index (issue 29 items 7, 11): whose index a start reads and when it adopts one.

- a foreign-owned ``lmcache-pool-*.warm`` / ``.warm.tmp`` in a sticky shm directory
  never stops a non-root daemon from starting (cold, one log line);
- an index rewritten while the new daemon waits for the segment's lock is refused,
  and an index of another installation is never adopted.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lmcache_client import PutStatus
from lmcache_server.storage.base import ChunkKey
from lmcache_server.storage.memory import warmstart
from lmcache_server.storage.memory.pool import INDEX_SUFFIX
from lmcache_server.storage.memory.warmstart import WarmIndex, WarmStart, boot_id, encode

from ...conftest import SHM_ROOT, Daemon

MiB = 1 << 20


def key(tag: str) -> bytes:
    return hashlib.sha256(tag.encode()).digest()


def value(k: bytes, size: int = MiB) -> bytes:
    return hashlib.shake_128(k).digest(size)


# -- item 7 ------------------------------------------------------------------------
NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
@pytest.mark.parametrize("suffix", [".warm", ".warm.tmp"])
def test_a_foreign_index_in_a_sticky_directory_does_not_stop_an_unprivileged_daemon(
    daemon_factory: Callable[..., Daemon], suffix: str
) -> None:
    """The daemon runs without any capability (root's uid, an empty bounding set: what
    a non-root user can do), in a sticky directory that another user owns, beside
    that user's unreadable index file it may neither read nor unlink."""
    shm = Path(tempfile.mkdtemp(prefix="lmcache-sticky-", dir=SHM_ROOT))
    try:
        os.chmod(shm, 0o1777)  # like /dev/shm
        segment = shm / ("lmcache-pool-1-" + "ab" * 16)
        foreign = shm / (segment.name + suffix)
        for path, data in ((segment, b""), (foreign, b"not yours")):
            path.write_bytes(data)
            os.chmod(path, 0o600)
            os.chown(path, NOBODY, NOBODY)
        os.chown(shm, NOBODY, NOBODY)
        d = daemon_factory(
            warm_restart=True,
            shm_dir=str(shm),
            prefix=["setpriv", "--bounding-set=-all", "--inh-caps=-all"],
        )
        with d.client() as c:
            assert c.uses_shared_memory
            k = key("after")
            assert c.put([k], [value(k)]) == [PutStatus.STORED]
        assert foreign.exists() and segment.exists()  # left alone
        assert d.stop() == 0
        log = d.log()
        assert "Traceback" not in log and "PermissionError" not in log
        assert log.count("not owned by this user") == 1
        d.start()  # its own clean stop is still adopted beside the foreign files
        assert "warm restart: adopted" in d.log()
        with d.client() as c:
            assert c.get([k]) == [value(k)]
    finally:
        shutil.rmtree(shm, ignore_errors=True)


# -- item 11 -----------------------------------------------------------------------
SEGMENT = "lmcache-pool-1-" + "cd" * 16
POOL = 4 * MiB


def _index(warm: WarmStart, chunks: list[tuple[ChunkKey, int, int, bool]], **changes: object) -> WarmIndex:
    fields: dict[str, object] = {
        "segment": SEGMENT,
        "pool_size": POOL,
        "identity": warm.identity,
        "installation": warm.installation,
        "boot_id": boot_id(),
        "written_at": time.time(),
        "chunks": chunks,
        "leases": [],
    }
    fields.update(changes)
    return WarmIndex(**fields)  # type: ignore[arg-type]


@pytest.fixture
def shm_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="lmcache-test-", dir=SHM_ROOT))
    (path / SEGMENT).write_bytes(b"\0" * POOL)
    yield path  # type: ignore[misc]
    shutil.rmtree(path, ignore_errors=True)


def test_an_index_rewritten_during_the_lock_wait_is_refused(shm_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    warm = WarmStart(shm_dir, ["tcp://127.0.0.1:1"], POOL)
    index_path = shm_dir / (SEGMENT + INDEX_SUFFIX)
    index_path.write_bytes(encode(_index(warm, [(ChunkKey("ns", b"\x01" * 32), 0, MiB, False)])))
    holder = os.open(shm_dir / SEGMENT, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # the old daemon, still stopping

    def rewrite_then_let_go() -> None:
        time.sleep(0.5)  # find() read the index and waits for the lock
        index_path.write_bytes(encode(_index(warm, [(ChunkKey("ns", b"\x02" * 32), MiB, MiB, False)])))
        os.close(holder)

    t = threading.Thread(target=rewrite_then_let_go)
    with caplog.at_level(logging.WARNING, logger=warmstart.__name__):
        t.start()
        try:
            adoption = warm.find()
        finally:
            t.join()
    assert adoption is None
    assert "changed while waiting for the segment's lock" in caplog.text


def test_an_unchanged_index_is_adopted_after_the_lock_wait(shm_dir: Path) -> None:
    warm = WarmStart(shm_dir, ["tcp://127.0.0.1:1"], POOL)
    (shm_dir / (SEGMENT + INDEX_SUFFIX)).write_bytes(
        encode(_index(warm, [(ChunkKey("ns", b"\x01" * 32), 0, MiB, False)]))
    )
    holder = os.open(shm_dir / SEGMENT, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    t = threading.Timer(0.3, os.close, [holder])
    t.start()
    adoption = warm.find()
    t.join()
    assert adoption is not None and len(adoption.index.chunks) == 1
    os.close(adoption.segment.fd)


def test_an_index_of_another_installation_is_never_adopted(shm_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    warm = WarmStart(shm_dir, ["tcp://127.0.0.1:1"], POOL)
    (shm_dir / (SEGMENT + INDEX_SUFFIX)).write_bytes(
        encode(_index(warm, [(ChunkKey("ns", b"\x01" * 32), 0, MiB, False)], installation="elsewhere"))
    )
    with caplog.at_level(logging.WARNING, logger=warmstart.__name__):
        assert warm.find() is None
    assert "another installation" in caplog.text
