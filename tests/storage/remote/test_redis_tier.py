"""The Redis uplink through real daemons and real redis-server processes (single node and cluster)."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from lmcache_client import PutStatus
from lmcache_client.protocol import KEY_BYTES

from ...conftest import NAMESPACE, SHM_ROOT, Daemon, RedisServer, wait_for

MiB = 1 << 20


def remote(c) -> dict:  # type: ignore[no-untyped-def, type-arg]
    return c.stats()["tiers"]["redis"]


def drained(daemon: Daemon) -> Callable[[], bool]:
    def check() -> bool:
        with daemon.client() as c:
            return bool(remote(c)["queued_writes"] == 0)

    return check


def test_chunk_put_on_one_daemon_is_a_hit_on_another(daemon_factory, redis_server: RedisServer) -> None:  # type: ignore[no-untyped-def]
    a = daemon_factory(remote_url=redis_server.url)
    b = daemon_factory(remote_url=redis_server.url)
    keys = [os.urandom(KEY_BYTES) for _ in range(4)]
    data = [os.urandom(300_000) for _ in keys]
    with a.client() as ca, b.client() as cb:
        assert remote(ca)["up"] is True
        assert ca.put(keys, data) == [PutStatus.STORED] * 4
        wait_for(drained(a))
        assert cb.lookup(keys).tiers == ["redis"] * 4
        assert [bytes(g) for g in cb.get(keys)] == data
        assert cb.lookup(keys).tiers == ["memory"] * 4  # promoted
        stats = remote(cb)
        assert stats["hits"] == 4 and stats["promotions"] == 4
    # Keys live under the prefix and carry the checksummed record.
    r = redis.Redis(port=redis_server.port)
    stored = list(r.scan_iter(match="lmcache:*"))
    assert len(stored) == 4
    assert r.get(stored[0])[:4] == b"LMKV"


def test_custom_prefix_and_ttl(daemon_factory, redis_server: RedisServer) -> None:  # type: ignore[no-untyped-def]
    a = daemon_factory(remote_url=redis_server.url, remote_key_prefix="team1/", remote_ttl_s=1.5)
    key = [os.urandom(KEY_BYTES)]
    with a.client() as c:
        c.put(key, [b"short-lived" * 1000])
        wait_for(drained(a))
    r = redis.Redis(port=redis_server.port)
    [rkey] = list(r.scan_iter(match="team1/*"))
    assert 0 < r.pttl(rkey) <= 1500
    wait_for(lambda: not r.exists(rkey), timeout_s=10)
    b = daemon_factory(remote_url=redis_server.url, remote_key_prefix="team1/")
    with b.client() as c:
        assert c.get(key) == [None]


def test_damaged_value_is_a_miss(daemon_factory, redis_server: RedisServer) -> None:  # type: ignore[no-untyped-def]
    a = daemon_factory(remote_url=redis_server.url)
    b = daemon_factory(remote_url=redis_server.url)
    keys = [os.urandom(KEY_BYTES) for _ in range(3)]
    with a.client() as c:
        c.put(keys, [os.urandom(50_000) for _ in keys])
        wait_for(drained(a))
    r = redis.Redis(port=redis_server.port)
    rkeys = sorted(r.scan_iter(match="lmcache:*"))
    value = bytearray(r.get(rkeys[0]))
    value[-1] ^= 0xFF
    r.set(rkeys[0], bytes(value))  # flipped payload byte
    r.set(rkeys[1], b"garbage")  # foreign value
    other = r.get(rkeys[2])
    with b.client() as c:
        got = c.get(keys)
        assert sum(g is None for g in got) == 2
        assert remote(c)["corrupt"] == 2
    assert r.get(rkeys[2]) == other  # the good one stays
    assert not r.exists(rkeys[0]) and not r.exists(rkeys[1])  # the damaged ones are removed


def test_redis_killed_mid_load_then_restarted(daemon_factory, redis_server: RedisServer) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory(remote_url=redis_server.url, remote_timeout_s=0.5)
    payload = os.urandom(64_000)
    with daemon.client() as c:
        for _ in range(20):
            assert c.put([os.urandom(KEY_BYTES)], [payload]) == [PutStatus.STORED]
        redis_server.stop()
        # No request fails because Redis failed: puts, gets and lookups go on.
        keys = [os.urandom(KEY_BYTES) for _ in range(40)]
        for key in keys:
            assert c.put([key], [payload]) == [PutStatus.STORED]
            assert bytes(c.get([key])[0]) == payload
            assert c.lookup([key, os.urandom(KEY_BYTES)]).hit_chunks == 1
        assert c.get([os.urandom(KEY_BYTES)]) == [None]
        wait_for(lambda: remote(c)["up"] is False)
        # Writes wait in the bounded queue while Redis is gone, none dropped.
        assert remote(c)["queued_writes"] >= len(keys) and remote(c)["dropped_writes"] == 0
        redis_server.start()  # same port (empty: it kept nothing)
        wait_for(lambda: remote(c)["up"] is True, timeout_s=30)
        assert remote(c)["reconnects"] >= 1
        late = [os.urandom(KEY_BYTES)]
        c.put(late, [payload])
        wait_for(drained(daemon))
    r = redis.Redis(port=redis_server.port)
    assert all(r.exists(redis_key_of(k)) for k in [*keys, *late])
    log = daemon.log()
    assert log.count("Redis uplink") >= 2 and "down" in log and "restored" in log


def test_daemon_starts_and_serves_with_redis_down(daemon_factory, redis_server: RedisServer) -> None:  # type: ignore[no-untyped-def]
    redis_server.stop()
    daemon = daemon_factory(remote_url=redis_server.url, remote_timeout_s=0.3)
    with daemon.client() as c:
        assert remote(c)["up"] is False
        key = [os.urandom(KEY_BYTES)]
        assert c.put(key, [b"x" * 1000]) == [PutStatus.STORED]
        assert c.get(key)[0] is not None
        redis_server.start()
        wait_for(lambda: remote(c)["up"] is True, timeout_s=30)


def test_password_from_url_and_wrong_password(daemon_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server = RedisServer(tmp_path / "auth", "--requirepass", "s3cret").start()
    try:
        good = daemon_factory(remote_url=f"redis://:s3cret@127.0.0.1:{server.port}")
        bad = daemon_factory(remote_url=f"redis://:wrong@127.0.0.1:{server.port}", remote_timeout_s=0.3)
        with good.client() as c:
            assert remote(c)["up"] is True
        with bad.client() as c:
            assert remote(c)["up"] is False
            key = [os.urandom(KEY_BYTES)]
            assert c.put(key, [b"still serving"]) == [PutStatus.STORED]
        assert "s3cret" not in good.log() and "wrong" not in bad.log()
        # The password can come from the environment instead of the URL.
        env = daemon_factory(remote_url=f"redis://127.0.0.1:{server.port}", env={"LMCACHE_REMOTE_PASSWORD": "s3cret"})
        with env.client() as c:
            assert remote(c)["up"] is True
    finally:
        server.stop()


def test_clear_removes_remote_keys(daemon_factory, redis_server: RedisServer) -> None:  # type: ignore[no-untyped-def]
    a = daemon_factory(remote_url=redis_server.url)
    with a.client() as c, a.client(namespace="other-ns") as other:
        c.put([os.urandom(KEY_BYTES) for _ in range(3)], [b"a"] * 3)
        other.put([os.urandom(KEY_BYTES)], [b"b"])
        wait_for(drained(a))
        assert c.clear() == 3
    r = redis.Redis(port=redis_server.port)
    assert len(list(r.scan_iter(match="lmcache:*"))) == 1


def test_sharing_through_redis_cluster(daemon_factory, redis_cluster: list[RedisServer]) -> None:  # type: ignore[no-untyped-def]
    url = f"redis+cluster://127.0.0.1:{redis_cluster[0].port}"
    a = daemon_factory(remote_url=url)
    b = daemon_factory(remote_url=f"redis+cluster://127.0.0.1:{redis_cluster[1].port}")
    keys = [os.urandom(KEY_BYTES) for _ in range(12)]
    data = [os.urandom(20_000) for _ in keys]
    with a.client() as ca, b.client() as cb:
        assert remote(ca)["up"] is True
        ca.put(keys, data)
        wait_for(drained(a))
        assert cb.lookup(keys).hit_chunks == 12
        assert [bytes(g) for g in cb.get(keys)] == data
    # The keys are spread over the nodes' slots.
    per_node = [redis.Redis(port=n.port).dbsize() for n in redis_cluster]
    assert sum(per_node) == 12 and sum(1 for n in per_node if n) >= 2


# -- kill -9 under load: nothing answered STORED is lost -----------------------------------------
def redis_key_of(key: bytes, namespace: str = NAMESPACE, prefix: str = "lmcache:") -> bytes:
    """The daemon's Redis key of a chunk (storage/remote/tier.py)."""
    return f"{prefix}{hashlib.sha256(namespace.encode()).hexdigest()[:16]}:{key.hex()}".encode()


@pytest.fixture
def durable_redis() -> Iterator[RedisServer]:
    """A redis-server whose AOF is written before each reply (on tmpfs: fast), so a
    kill -9 loses nothing it acknowledged and a restart in the same dir brings it back."""
    workdir = Path(tempfile.mkdtemp(prefix="lmcache-redis-", dir=SHM_ROOT))
    server = RedisServer(workdir, "--appendonly", "yes", "--appendfsync", "always").start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


class PutLoad:
    """A client process's worth of puts in a thread: every key answered STORED is kept."""

    def __init__(self, daemon: Daemon, payload_bytes: int = 32_000):
        self.daemon = daemon
        self.payload = os.urandom(payload_bytes)
        self.stored: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            with self.daemon.client() as c:
                while not self._stop.is_set():
                    key = os.urandom(KEY_BYTES)
                    if c.put([key], [self.payload]) == [PutStatus.STORED]:
                        self.stored.append(key)
        except BaseException as err:  # surfaced by stop()
            self.error = err

    def __enter__(self) -> PutLoad:
        self._thread.start()
        return self

    def more(self, n: int) -> None:
        """Wait until ``n`` more puts were answered STORED."""
        target = len(self.stored) + n
        wait_for(lambda: len(self.stored) >= target or self.error is not None, timeout_s=60)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        assert self.error is None, self.error


@pytest.mark.timeout(180)
def test_every_stored_put_reaches_redis_across_kill_and_restart(daemon_factory, durable_redis: RedisServer) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory(remote_url=durable_redis.url, remote_timeout_s=0.5)
    with daemon.client() as c, PutLoad(daemon) as load:
        load.more(200)
        for _ in range(2):
            durable_redis.stop()  # SIGKILL, under load
            # Wait until the daemon saw the outage: a restart inside the writer's
            # per-command retries would otherwise hide it, and the log counts below vary.
            wait_for(lambda: remote(c)["up"] is False, timeout_s=60)
            load.more(100)  # puts go on while Redis is gone
            durable_redis.start()  # same port, same AOF
            wait_for(lambda: remote(c)["up"] is True, timeout_s=60)
            load.more(300)  # and right after it is back
    wait_for(drained(daemon), timeout_s=60)
    with daemon.client() as c:
        stats = remote(c)
    r = redis.Redis(port=durable_redis.port)
    missing = [k for k in load.stored if not r.exists(redis_key_of(k))]
    assert (len(missing), stats["dropped_writes"]) == (0, 0), f"{len(missing)} of {len(load.stored)} lost: {stats}"
    # One outage per kill: no "restored" followed by "down" on a connection to the old server.
    log = daemon.log()
    assert (log.count("Redis uplink"), log.count(" down ("), log.count(" restored")) == (5, 2, 2), log


def test_delete_and_clear_purge_the_write_queue(daemon_factory, redis_server: RedisServer) -> None:  # type: ignore[no-untyped-def]
    """A chunk deleted (or cleared) while its write is still queued never reaches
    Redis afterwards.  Redis is frozen (SIGSTOP), so nothing drains meanwhile."""
    daemon = daemon_factory(remote_url=redis_server.url, remote_timeout_s=5)
    keep = [os.urandom(KEY_BYTES) for _ in range(3)]
    doomed = [os.urandom(KEY_BYTES) for _ in range(3)]
    cleared = [os.urandom(KEY_BYTES) for _ in range(2)]
    assert redis_server.proc is not None
    with daemon.client() as c, daemon.client(namespace="other-ns") as other:
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            # doomed[0] goes first: its write is the one on its way when it is deleted.
            assert c.put([doomed[0], *keep, *doomed[1:]], [b"d" * 5000] * 6) == [PutStatus.STORED] * 6
            assert other.put(cleared, [b"c" * 5000] * 2) == [PutStatus.STORED] * 2
            wait_for(lambda: remote(c)["queued_writes"] == 8)

            # delete and clear wait for the frozen Redis: send them from other threads,
            # and see them take their chunks out of the queue at once.
            def delete() -> None:
                with daemon.client() as own:
                    own.delete(doomed)

            def clear() -> None:
                with daemon.client(namespace="other-ns") as own:
                    own.clear()

            removals = [threading.Thread(target=delete), threading.Thread(target=clear)]
            for t in removals:
                t.start()
            wait_for(lambda: remote(c)["queued_writes"] == 3)
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        for t in removals:
            t.join(30)
        wait_for(lambda: remote(c)["up"] is True and remote(c)["queued_writes"] == 0, timeout_s=30)
        wait_for(lambda: remote(c)["pending_removals"] == 0, timeout_s=30)
    r = redis.Redis(port=redis_server.port)
    assert [bool(r.exists(redis_key_of(k))) for k in keep] == [True] * 3
    assert [bool(r.exists(redis_key_of(k))) for k in doomed] == [False] * 3
    assert [bool(r.exists(redis_key_of(k, "other-ns"))) for k in cleared] == [False] * 2


def test_delete_while_redis_is_down_reaches_it_when_back(daemon_factory, redis_server: RedisServer) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory(remote_url=redis_server.url, remote_timeout_s=0.5)
    keys = [os.urandom(KEY_BYTES) for _ in range(4)]
    r = redis.Redis(port=redis_server.port)
    assert redis_server.proc is not None
    with daemon.client() as c, daemon.client(namespace="other-ns") as other:
        c.put(keys, [b"k" * 5000] * 4)
        other.put(keys, [b"o" * 5000] * 4)
        wait_for(drained(daemon))
        assert sum(r.exists(redis_key_of(k)) + r.exists(redis_key_of(k, "other-ns")) for k in keys) == 8
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            c.lookup([os.urandom(KEY_BYTES)])  # asks Redis, times out: the uplink goes down
            wait_for(lambda: remote(c)["up"] is False, timeout_s=30)
            assert c.delete(keys[:2]) == [True, True]  # from memory now, from Redis once it is back
            other.clear()
            assert remote(c)["pending_removals"] == 3  # two deletes, one clear
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        wait_for(lambda: remote(c)["up"] is True and remote(c)["pending_removals"] == 0, timeout_s=30)
    assert [bool(r.exists(redis_key_of(k))) for k in keys] == [False, False, True, True]
    assert not any(r.exists(redis_key_of(k, "other-ns")) for k in keys)


# -- removals and queued writes survive a clean stop (issue 29 item 10) -------------------
def _stored_in_redis(daemon: Daemon, redis: RedisServer, keys: list[bytes], payload: bytes) -> None:
    with daemon.client() as c:
        assert c.put(keys, [payload] * len(keys)) == [PutStatus.STORED] * len(keys)
        wait_for(lambda: remote(c)["queued_writes"] == 0 and remote(c)["up"])


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
        wait_for(lambda: remote(c)["pending_removals"] == 0 and remote(c)["up"])
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
        wait_for(lambda: remote(c)["up"] is False)
        assert remote(c)["queued_writes"] == 3
    assert daemon.stop() == 0
    durable_redis.start()
    daemon.start()
    with daemon.client() as c:
        wait_for(lambda: remote(c)["queued_writes"] == 0 and remote(c)["up"], timeout_s=30)
    r = redis.Redis(port=durable_redis.port)
    assert all(r.exists(redis_key_of(k)) for k in keys)
    assert "re-queued 3" in daemon.log()
