"""``disk_admission: reused`` through the real daemon over ZeroMQ (issue #27 item 6):
a chunk put once and evicted is not written to disk; a chunk put, read, then
evicted is, and is served back from disk with its bytes."""

from __future__ import annotations

from lmcache_client import PutStatus

from ...conftest import chunk_files, disk_stats, wait_for
from ...metrics.test_metrics import scrape
from .test_disk_tier import MiB, keys_and_data


def test_reused_writes_only_read_chunks_to_disk(disk_daemon) -> None:  # type: ignore[no-untyped-def]
    daemon = disk_daemon(disk_admission="reused", cache_policy="lru")
    keys, data = keys_and_data(2)
    once, read = keys
    fillers, filler_data = keys_and_data(16)
    with daemon.client() as c:
        for k, d in zip(keys, data):
            assert c.put([k], [d]) == [PutStatus.STORED]
        assert bytes(c.get([read])[0]) == data[1]  # read once: reused
        for k, d in zip(fillers, filler_data):  # 16 MiB through an 8 MiB pool: both evicted
            assert c.put([k], [d]) == [PutStatus.STORED]
        assert c.lookup([once, read]).tiers[1] != "memory"
        wait_for(lambda: disk_stats(c)["spills"] >= 1 and disk_stats(c)["queued_spills"] == 0)
        stats = disk_stats(c)
        assert stats["admission"] == "reused"
        assert stats["admitted"] == 1 and stats["spills"] == 1
        assert stats["declined"] >= 9 and stats["declined_bytes"] == stats["declined"] * MiB
        assert len(chunk_files(disk_daemon.root)) == 1
        # Put once, evicted: gone (not on disk, a miss).
        assert c.lookup([once]).hit_chunks == 0
        assert c.get([once]) == [None]
        # Put, read, evicted: on disk, served from there with its bytes.
        assert c.lookup([read]).tiers == ["disk"]
        hits = disk_stats(c)["hits"]
        assert bytes(c.get([read])[0]) == data[1]
        assert disk_stats(c)["hits"] == hits + 1
        # The counters on /metrics (the promotion above evicted one more chunk: declined).
        declined = disk_stats(c)["declined"]
        assert declined == stats["declined"] + 1
        metrics = scrape(daemon.metrics_port)
    assert sample(metrics, "lmcache_tier_admitted_total") == 1
    assert sample(metrics, "lmcache_tier_admission_declined_total") == declined
    assert sample(metrics, "lmcache_tier_admission_declined_bytes_total") == declined * MiB


def sample(metrics: str, name: str) -> float:
    """The value of ``name{tier="disk"}`` in a scrape."""
    prefix = name + '{tier="disk"} '
    return float(next(line for line in metrics.splitlines() if line.startswith(prefix))[len(prefix) :])
