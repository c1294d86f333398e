"""The Mooncake tier through real daemons (two nodes on one host) and a real ``mooncake_master``
with its HTTP metadata server: a chunk put through node A is a hit on node B with identical
bytes; the master killed and restarted; a node that leaves; another installation's values."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from typing import Any

from lmcache_client import PutStatus
from lmcache_client.protocol import KEY_BYTES

from ...conftest import NAMESPACE, Daemon, MooncakeMaster, wait_for
from ...metrics.test_metrics import scrape

MiB = 1 << 20


def remote(c: Any) -> dict[str, Any]:
    return c.stats()["tiers"]["mooncake"]  # type: ignore[no-any-return]


def drained(daemon: Daemon) -> Callable[[], bool]:
    def check() -> bool:
        with daemon.client() as c:
            stats = remote(c)
            return bool(stats["up"] and stats["queued_writes"] == 0)

    return check


def nodes(daemon_factory: Callable[..., Daemon], master: MooncakeMaster, **config: Any) -> tuple[Daemon, Daemon]:
    return daemon_factory(**master.daemon_config(**config)), daemon_factory(**master.daemon_config(**config))


def put_through(daemon: Daemon, n: int, size: int = 300_000) -> tuple[list[bytes], list[bytes]]:
    keys = [os.urandom(KEY_BYTES) for _ in range(n)]
    data = [os.urandom(size) for _ in keys]
    with daemon.client() as c:
        assert c.put(keys, data) == [PutStatus.STORED] * n
    wait_for(drained(daemon))
    return keys, data


def test_a_chunk_put_through_node_a_is_a_hit_on_node_b(daemon_factory, mooncake_master: MooncakeMaster) -> None:  # type: ignore[no-untyped-def]
    a, b = nodes(daemon_factory, mooncake_master)
    keys, data = put_through(a, 6)
    with a.client() as ca, b.client() as cb:
        assert remote(ca)["stores"] == 6 and remote(ca)["engine"] == "mooncake"
        assert cb.lookup(keys).tiers == ["mooncake"] * 6
        assert [bytes(g) for g in cb.get(keys)] == data
        assert cb.lookup(keys).tiers == ["memory"] * 6  # promoted into B's pool
        stats = remote(cb)
        assert stats["hits"] == 6 and stats["promotions"] == 6 and stats["corrupt"] == 0
        missing = os.urandom(KEY_BYTES)
        assert cb.get([missing]) == [None]
        assert remote(cb)["misses"] >= 1
    # Prometheus: the tier's state and its requests by operation.
    text = scrape(b.metrics_port)
    assert 'lmcache_tier_up{tier="mooncake"} 1.0' in text
    assert 'lmcache_tier_hits_total{tier="mooncake"} 6.0' in text
    reads = re.search(r'lmcache_tier_ops_total\{op="read",tier="mooncake"\} (\S+)', text)
    assert reads is not None and float(reads.group(1)) >= 2, text
    assert re.search(r'lmcache_tier_ops_total\{op="write",tier="mooncake"\}', scrape(a.metrics_port))


def test_another_installation_never_reads_these_chunks(daemon_factory, mooncake_master: MooncakeMaster) -> None:  # type: ignore[no-untyped-def]
    a = daemon_factory(**mooncake_master.daemon_config(remote_key_prefix="team-a:"))
    other = daemon_factory(**mooncake_master.daemon_config(remote_key_prefix="team-b:"))
    keys, data = put_through(a, 3)
    with other.client() as c:
        assert c.lookup(keys).tiers == [None] * 3
        assert c.get(keys) == [None] * 3
        assert remote(c)["hits"] == 0
        # The same keys under its own prefix are its own chunks, not team-a's.
        mine = [os.urandom(200_000) for _ in keys]
        assert c.put(keys, mine) == [PutStatus.STORED] * 3
    wait_for(drained(other))
    fresh = daemon_factory(**mooncake_master.daemon_config(remote_key_prefix="team-a:"))
    with fresh.client() as c:
        assert [bytes(g) for g in c.get(keys)] == data


def test_clear_and_delete_remove_the_values_from_mooncake(daemon_factory, mooncake_master: MooncakeMaster) -> None:  # type: ignore[no-untyped-def]
    a, b = nodes(daemon_factory, mooncake_master)
    keys, data = put_through(a, 4)
    with a.client() as ca:
        assert ca.delete(keys[:1]) == [True]
        ca.clear()
    with b.client() as cb:
        assert cb.lookup(keys).tiers == [None] * 4
        assert cb.get(keys) == [None] * 4


def test_the_master_killed_and_restarted(daemon_factory, mooncake_master: MooncakeMaster) -> None:  # type: ignore[no-untyped-def]
    a, b = nodes(daemon_factory, mooncake_master, remote_timeout_s=1.0)
    before, before_data = put_through(a, 3)
    mooncake_master.stop()
    # Puts keep being acknowledged from memory; reads of what only Mooncake held fail open.
    during = [os.urandom(KEY_BYTES) for _ in range(3)]
    during_data = [os.urandom(200_000) for _ in during]
    with a.client() as ca, b.client() as cb:
        assert ca.put(during, during_data) == [PutStatus.STORED] * 3
        assert [bytes(g) for g in ca.get(during)] == during_data  # from A's memory
        assert cb.get(before) == [None] * 3
        wait_for(lambda: remote(ca)["up"] is False, timeout_s=30)  # its writes failed
        assert cb.get(before) == [None] * 3 and cb.lookup(before).tiers == [None] * 3
    mooncake_master.start()
    # Both nodes come back by themselves; the new master knows nothing of the old values
    # (misses, never errors), and what A queued while it was down is written now.
    wait_for(drained(a), timeout_s=60)
    wait_for(lambda: remote(b.client())["up"] is True, timeout_s=60)
    with a.client() as ca, b.client() as cb:
        assert remote(ca)["reconnects"] >= 1
        assert cb.get(before) == [None] * 3
        got = cb.get(during)
        assert all(g is None or bytes(g) == d for g, d in zip(got, during_data))
        # Writes after the restart are shared again.
    after, after_data = put_through(a, 3)
    with b.client() as cb:
        wait_for(lambda: cb.lookup(after).tiers == ["mooncake"] * 3, timeout_s=30)
        assert [bytes(g) for g in cb.get(after)] == after_data
        assert remote(cb)["corrupt"] == 0


def test_a_node_that_leaves_takes_its_values_along(daemon_factory, mooncake_master: MooncakeMaster) -> None:  # type: ignore[no-untyped-def]
    # A contributes the only segment (B contributes none), so every value lives in A's DRAM.
    a = daemon_factory(**mooncake_master.daemon_config())
    b = daemon_factory(**mooncake_master.daemon_config(mooncake_segment_size=0))
    keys, _ = put_through(a, 4)
    with b.client() as cb:
        assert cb.lookup(keys).tiers == ["mooncake"] * 4
    a.stop()  # its segment is unmounted
    with b.client() as cb:
        wait_for(lambda: cb.lookup(keys).tiers == [None] * 4, timeout_s=30)
        assert cb.get(keys) == [None] * 4
        stats = remote(cb)
        assert stats["corrupt"] == 0
        # B keeps serving its own puts from memory (with no segment left, Mooncake has no room).
        own = [os.urandom(KEY_BYTES)]
        assert cb.put(own, [b"x" * 1000]) == [PutStatus.STORED]
        assert [bytes(g) for g in cb.get(own)] == [b"x" * 1000]


def test_the_daemon_starts_and_serves_with_the_master_down(daemon_factory, mooncake_master: MooncakeMaster) -> None:  # type: ignore[no-untyped-def]
    mooncake_master.stop()
    a = daemon_factory(**mooncake_master.daemon_config(remote_timeout_s=0.5))
    keys = [os.urandom(KEY_BYTES)]
    with a.client() as ca:
        assert remote(ca)["up"] is False
        assert ca.put(keys, [b"y" * 5000]) == [PutStatus.STORED]
        assert [bytes(g) for g in ca.get(keys)] == [b"y" * 5000]
    mooncake_master.start()
    wait_for(drained(a), timeout_s=60)
    with a.client() as ca:
        assert remote(ca)["stores"] == 1


def leased(daemon: Daemon) -> int:
    with daemon.client() as c:
        return int(c.stats()["tiers"]["memory"]["leased_chunks"])


def test_pool_writes_hold_their_chunks_until_written_or_removed(
    daemon_factory, mooncake_master: MooncakeMaster
) -> None:  # type: ignore[no-untyped-def]
    # The master is down: the writes wait in the queue, each holding its chunk in the pool.
    mooncake_master.stop()
    a = daemon_factory(**mooncake_master.daemon_config(remote_timeout_s=0.5))
    keys = [os.urandom(KEY_BYTES) for _ in range(4)]
    data = [os.urandom(250_000) for _ in keys]
    with a.client() as ca:
        assert ca.put(keys, data) == [PutStatus.STORED] * 4
        wait_for(lambda: leased(a) == 4)
        assert ca.delete(keys[:1]) == [True]  # a removed write gives its chunk back
        wait_for(lambda: leased(a) == 3)
    mooncake_master.start()
    wait_for(drained(a), timeout_s=60)
    assert leased(a) == 0  # written: every lease given back
    b = daemon_factory(**mooncake_master.daemon_config())
    with b.client() as cb:
        assert cb.get(keys[:1]) == [None]
        assert [bytes(g) for g in cb.get(keys[1:])] == data[1:]


def test_copied_records_when_zero_copy_is_off(daemon_factory, mooncake_master: MooncakeMaster) -> None:  # type: ignore[no-untyped-def]
    a, b = nodes(daemon_factory, mooncake_master, mooncake_zero_copy=False)
    keys, data = put_through(a, 3, size=2 * MiB)
    assert leased(a) == 0
    with b.client() as cb:
        assert [bytes(g) for g in cb.get(keys)] == data


def test_a_damaged_or_torn_value_is_a_miss_never_wrong_bytes(daemon_factory, mooncake_master: MooncakeMaster) -> None:  # type: ignore[no-untyped-def]
    from mooncake.store import MooncakeDistributedStore

    a, b = nodes(daemon_factory, mooncake_master)
    keys, data = put_through(a, 3)
    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", mooncake_master.metadata_server, 16 * MiB, 16 * MiB, "tcp", "",
                     mooncake_master.url.removeprefix("mooncake://")) == 0  # fmt: skip
    try:
        names = [f"lmcache:{hashlib.sha256(NAMESPACE.encode()).hexdigest()[:16]}:{k.hex()}" for k in keys]
        record = raw.get(names[0])
        assert record[-len(data[0]) :] == data[0]  # the record ends with the payload
        # A torn value (the record cut short), a value with one payload byte flipped, garbage.
        flipped = bytearray(record)
        flipped[-1] ^= 0xFF
        for name, value in zip(names, (record[: len(record) // 2], bytes(flipped), b"not a record")):
            assert raw.remove(name, True) == 0 and raw.put(name, value) == 0
        with b.client() as cb:
            assert cb.get(keys) == [None] * 3
            stats = remote(cb)
            assert stats["corrupt"] == 3 and stats["hits"] == 0
        assert raw.batch_is_exist(names) == [0, 0, 0]  # removed: the next put writes them again
    finally:
        raw.close()
