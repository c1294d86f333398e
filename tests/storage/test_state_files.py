"""The daemon's state files (issue 39, item 2): nothing another local user plants in the
world-writable ``shm_dir`` is read, written through, or can stop a start or a stop.

Without ``local_disk`` the Redis pending-removals file and the kept KV events used to
live in ``shm_dir`` under names anyone can compute, and the warm index was written
through a fixed temporary name beside the pool segment.  Each test plants what another
user could (files owned by uid 65534, as the tests run as root; 0666 where the issue
says so; a symlink) against a real daemon and a real redis-server, then checks that the
daemon starts, Redis keeps its keys, nothing leaks into the planted file, and the clean
stop still writes its own state, in the private state directory
(lmcache_server/storage/statefiles.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import redis

from lmcache_client.keys import chunk_keys, chunk_tokens
from lmcache_client.protocol import PutStatus
from lmcache_server.events import keep
from lmcache_server.storage import statefiles
from lmcache_server.storage.statefiles import UntrustedFile, private_dir, read_private, write_private

from ..conftest import NAMESPACE, Daemon, RedisServer, wait_for
from ..events.test_events import BLOCK, CHUNK, NS, events_daemon, quiet, replay
from ..server.events_router import RouterIndex

OTHER_UID = 65534  # nobody: "another local user"
PREFIX = "lmcache:"


def plant(path: Path, data: bytes = b"", mode: int = 0o666) -> Path:
    """``path`` created as another user's file (owner ``OTHER_UID``, ``mode``)."""
    path.write_bytes(data)
    os.chown(path, OTHER_UID, OTHER_UID)
    os.chmod(path, mode)
    return path


def plant_link(path: Path, target: Path) -> Path:
    path.symlink_to(target)
    os.lchown(path, OTHER_UID, OTHER_UID)
    return path


def tag(d: Daemon) -> str:
    """The listen tag the old shm_dir file names carried (computable by anyone)."""
    return hashlib.sha256("\n".join(d.config["listen"]).encode()).hexdigest()[:16]


def segment_of(d: Daemon) -> Path:
    (segment,) = [p for p in d.shm_dir.iterdir() if p.name.startswith("lmcache-pool-") and "." not in p.name]
    return segment


def foreign_files(d: Daemon) -> list[Path]:
    return sorted(p for p in d.shm_dir.iterdir() if p.lstat().st_uid == OTHER_UID)


def redis_keys(server: RedisServer) -> list[bytes]:
    return sorted(redis.Redis.from_url(server.url).keys(PREFIX + "*"))  # type: ignore[arg-type]


# -- (a) a planted pending-removals file --------------------------------------------------
def test_a_planted_pending_file_never_clears_the_shared_redis(
    daemon_factory: Callable[..., Daemon], redis_server: RedisServer
) -> None:
    """Another user's ``{"clears": [null]}`` (and ``deletes``) under the old pending name in
    ``shm_dir``: the daemon starts, every key of the shared Redis stays, the file is left alone."""
    d = daemon_factory(remote_url=redis_server.url)
    assert d.stop() == 0
    r = redis.Redis.from_url(redis_server.url)
    others = {f"{PREFIX}{i:016x}:{'ab' * 32}".encode(): os.urandom(64) for i in range(20)}
    r.mset(others)  # type: ignore[arg-type]
    chosen = hashlib.sha256(b"chosen").digest()
    r.set(f"{PREFIX}{hashlib.sha256(NS.encode()).hexdigest()[:16]}:{chosen.hex()}", b"v")
    target = f"{redis_server.url} {PREFIX}"
    doc = {"version": 1, "target": target, "clears": [None], "deletes": [[NS, chosen.hex()]], "writes": []}
    planted = plant(d.shm_dir / f"lmcache-redis-pending-{tag(d)}.json", json.dumps(doc).encode(), 0o644)
    d.start()
    mine = hashlib.sha256(b"mine").digest()
    with d.client() as c:
        assert c.put([mine], [os.urandom(4096)]) == [PutStatus.STORED]
    # Removals owed are sent before any later write: once this write is in Redis, a clear
    # read from the planted file would have run.
    wait_for(lambda: len(redis_keys(redis_server)) >= 22, timeout_s=10)
    assert len(redis_keys(redis_server)) == 22  # 20 + the chosen key + this write
    assert planted.read_bytes() == json.dumps(doc).encode() and planted.lstat().st_uid == OTHER_UID
    assert "pending at the last stop" not in d.log()


# -- (b) a planted kept-events file -------------------------------------------------------
def test_a_planted_kept_events_file_is_never_announced(daemon_factory: Callable[..., Daemon]) -> None:
    """A readable kept-events file of another user, under the old name, naming a chunk the
    daemon holds after a warm restart with token ids that are not the chunk's: nothing is
    announced from it, and the daemon starts."""
    d = events_daemon(daemon_factory, warm_restart=True)
    held = hashlib.sha256(b"held without token ids").digest()
    with d.client(namespace=NS) as c:
        assert c.put([held], [os.urandom(8192)]) == [PutStatus.STORED]  # no token ids: never announced
    assert d.stop() == 0
    forged = chunk_tokens([(i * 7) % 50_000 for i in range(CHUNK)], CHUNK)[0]
    assert forged is not None
    hashes = os.urandom(8 * (CHUNK // BLOCK))
    record = (NS, held, -1, hashes, forged.packed, forged.parent)
    plant(d.shm_dir / f"lmcache-events-kept-{tag(d)}.msgpack", keep.HEADER + msgpack.packb(record), 0o644)
    d.start()
    with d.client(namespace=NS) as c:
        assert c.lookup([held]).tiers == ["memory"]  # adopted: the planted record's key is held
        quiet(c)
        assert c.stats()["events"]["restored_chunks"] == 0
    assert RouterIndex(BLOCK).apply(replay(d)).state() == {}


def test_a_kept_file_that_cannot_be_removed_is_one_line_not_a_failed_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An unlink that fails (another user's file in a sticky directory) is logged; the
    records are still read once, and loading never raises."""
    tokens = [(i * 3) % 50_000 for i in range(CHUNK)]
    (key,), (tok,) = chunk_keys(tokens, CHUNK), chunk_tokens(tokens, CHUNK)
    assert tok is not None
    path = tmp_path / "events-kept.msgpack"
    record = (NS, key, -1, bytes(8 * (CHUNK // BLOCK)), tok.packed, tok.parent)
    path.write_bytes(keep.HEADER + msgpack.packb(record))
    real = Path.unlink

    def refused(self: Path, missing_ok: bool = False) -> None:
        if self == path:
            raise PermissionError(1, "Operation not permitted", str(self))
        real(self, missing_ok)

    monkeypatch.setattr(Path, "unlink", refused)
    (kept,) = keep.load(path)
    assert kept.key.digest == key
    assert "cannot remove the kept KV events file" in caplog.text


def test_saving_never_raises_into_the_stop(tmp_path: Path) -> None:
    """A state file that cannot be written is one line: the stop goes on to close the store."""
    missing = tmp_path / "gone" / "events-kept.msgpack"
    assert keep.save(missing, []) == 0

    def broken() -> object:
        raise RuntimeError("an announcer that fails mid-way")
        yield  # pragma: no cover

    assert keep.save(tmp_path / "events-kept.msgpack", broken()) == 0  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind


# -- (c) planted temporary files and a symlink ---------------------------------------------
@pytest.mark.parametrize("index_plant", ["file", "symlink"])
def test_planted_temporary_files_receive_nothing_and_the_stop_writes_its_state(
    daemon_factory: Callable[..., Daemon], tmp_path: Path, index_plant: str
) -> None:
    """A 0666 file of another user under the old temporary name of the kept events, and
    under the warm index's either such a file or a symlink to a file of the daemon's
    user: nothing is written into them (no token ids, no index), the victim is intact,
    and the clean stop still writes its state: the next start adopts the pool and
    announces the chunks again."""
    d = events_daemon(daemon_factory, warm_restart=True)
    tokens = [(i * 11) % 50_000 for i in range(2 * CHUNK)]
    keys, toks = chunk_keys(tokens, CHUNK), chunk_tokens(tokens, CHUNK)
    with d.client(namespace=NS) as c:
        assert c.put(keys, [os.urandom(8192) for _ in keys], tokens=toks) == [PutStatus.STORED] * 2
        quiet(c, announced_chunks=2)
    segment = segment_of(d)
    kept_tmp = plant(d.shm_dir / f"lmcache-events-kept-{tag(d)}.msgpack.tmp")
    victim = tmp_path / "victim"
    victim.write_bytes(b"a file of the daemon's user")
    index_tmp = d.shm_dir / f"{segment.name}.warm.tmp"
    if index_plant == "file":
        plant(index_tmp)
    else:
        plant_link(index_tmp, victim)
    assert d.stop() == 0
    assert victim.read_bytes() == b"a file of the daemon's user" and index_tmp.is_symlink() == (index_plant != "file")
    assert kept_tmp.read_bytes() == b""
    if index_plant == "file":
        assert index_tmp.read_bytes() == b""
    assert foreign_files(d) == sorted([kept_tmp, index_tmp])  # nothing of ours became theirs
    packed = b"".join(t.to_bytes(4, "little") for t in tokens[:8])
    for p in d.shm_dir.iterdir():
        if p.is_file() and not p.is_symlink() and p != segment:
            assert packed not in p.read_bytes(), p  # no token ids in shm_dir
    state = d.workdir / "state" / "lmcache-server"
    kept = state / f"events-kept-{tag(d)}.msgpack"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600 and stat.S_IMODE(state.stat().st_mode) == 0o700
    index = segment.with_name(segment.name + ".warm")
    assert index.lstat().st_uid == os.geteuid() and stat.S_IMODE(index.lstat().st_mode) == 0o600
    d.start()
    assert "warm restart: adopted " + segment.name in d.log()
    with d.client(namespace=NS) as c:
        assert c.lookup(keys).tiers == ["memory"] * 2
        quiet(c, restored_chunks=2)
    assert sum(len(b) for b in RouterIndex(BLOCK).apply(replay(d)).state().values()) == 2 * CHUNK // BLOCK


def test_the_pending_removals_are_kept_in_the_private_state_directory(
    daemon_factory: Callable[..., Daemon], redis_server: RedisServer
) -> None:
    """A delete Redis was not told about (it was down at the stop) is written 0600 into
    the state directory, not ``shm_dir``, and sent at the next start."""
    d = daemon_factory(remote_url=redis_server.url, remote_timeout_s=0.5)
    k = hashlib.sha256(b"deleted while redis is down").digest()
    with d.client() as c:
        assert c.put([k], [os.urandom(4096)]) == [PutStatus.STORED]
    wait_for(lambda: len(redis_keys(redis_server)) == 1)
    redis_server.stop()
    with d.client() as c:
        assert c.delete([k]) == [True]
    assert d.stop() == 0
    pending = d.workdir / "state" / "lmcache-server" / f"redis-pending-{tag(d)}.json"
    assert stat.S_IMODE(pending.stat().st_mode) == 0o600
    assert not [p for p in d.shm_dir.iterdir() if "redis" in p.name]
    redis_server.start()  # empty again (no persistence)
    r = redis.Redis.from_url(redis_server.url)
    stale = f"{PREFIX}{hashlib.sha256(NAMESPACE.encode()).hexdigest()[:16]}:{k.hex()}"
    r.set(stale, b"a copy written back by another node")
    d.start()
    wait_for(lambda: r.get(stale) is None, timeout_s=10)  # the delete owed is sent first
    assert not pending.exists()


# -- the state directory itself -----------------------------------------------------------
def test_a_state_dir_another_user_owns_refuses_the_start(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    proc = subprocess.run(
        [sys.executable, "-m", "lmcache_server", "--set", f"state_dir={theirs}", "--set", "metrics_port=0",
         "--set", "shared_memory=false", "--set", "listen=[\"ipc://" + str(tmp_path / "s.sock") + "\"]"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "state_dir" in proc.stderr and "uid 65534" in proc.stderr


def test_state_files_are_read_and_written_privately(tmp_path: Path) -> None:
    root = private_dir(tmp_path / "state")
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    path = root / "f.json"
    with write_private(path) as f:
        f.write(b"{}")
    assert read_private(path, 16) == b"{}" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_private(root / "none", 16) is None
    with pytest.raises(UntrustedFile):
        read_private(path, 1)  # larger than the bound
    theirs = plant(root / "theirs.json", b"{}", 0o644)
    with pytest.raises(UntrustedFile):
        read_private(theirs, 16)
    link = root / "link.json"
    link.symlink_to(path)
    with pytest.raises(UntrustedFile):
        read_private(link, 16)
    fifo = root / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UntrustedFile):
        read_private(fifo, 16)  # never blocks the start
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o1777)
    with pytest.raises(UntrustedFile):
        private_dir(open_dir)
    owned = tmp_path / "owned"
    owned.mkdir()
    os.chown(owned, OTHER_UID, OTHER_UID)
    with pytest.raises(UntrustedFile):
        private_dir(owned)
    with pytest.raises(RuntimeError), write_private(root / "g.json") as f:
        f.write(b"half")
        raise RuntimeError("a failed write leaves no temporary file")
    assert sorted(p.name for p in root.iterdir()) == ["f.json", "fifo", "link.json", "theirs.json"]
    assert statefiles.temp_target("lmcache-pool-1-" + "a" * 32 + ".warm.0123456789abcdef.tmp") is not None


def test_a_stopped_daemon_never_leaves_state_in_shm_dir(daemon_factory: Callable[..., Daemon]) -> None:
    """Only the pool segment and its warm index (by design, beside it) are in ``shm_dir``."""
    d = events_daemon(daemon_factory, warm_restart=True)
    assert d.stop(signal.SIGTERM) == 0
    names = [p.name for p in d.shm_dir.iterdir()]
    assert all(n.startswith("lmcache-pool-") for n in names), names


def test_an_implicit_state_directory_that_is_not_private_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The default directory (or a spill directory) another user owns or may write: the
    daemon keeps no state (one WARNING line) instead of trusting it; a configured one
    raises (the start is refused, above)."""
    theirs = tmp_path / "xdg"
    (theirs / "lmcache-server").mkdir(parents=True)
    os.chown(theirs / "lmcache-server", OTHER_UID, OTHER_UID)
    monkeypatch.setenv("XDG_STATE_HOME", str(theirs))
    assert statefiles.resolve(None, None, ["tcp://127.0.0.1:1"]) is None
    assert "no private state directory" in caplog.text
    shared = tmp_path / "spill"
    shared.mkdir()
    os.chmod(shared, 0o777)
    assert statefiles.resolve(None, shared, ["tcp://127.0.0.1:1"]) is None
    with pytest.raises(UntrustedFile):
        statefiles.resolve(str(shared), None, ["tcp://127.0.0.1:1"])
    mine = statefiles.resolve(str(tmp_path / "mine"), None, ["tcp://127.0.0.1:1"])
    assert mine is not None and mine.file("redis-pending", ".json").name.startswith("redis-pending-")
