"""ChunkTransfer.get_prefix_into: the adapters' read path, straight from the daemon's pool
into the engine's buffers, against a real daemon over shared memory and over frames."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from lmcache_client.integrations.transfer import ChunkTransfer

from ..conftest import NAMESPACE, Daemon

CHUNK = 256 * 1024


def key(i: int) -> bytes:
    return hashlib.sha256(f"transfer-{i}".encode()).digest()


def payload(i: int, size: int = CHUNK) -> bytes:
    return hashlib.shake_128(key(i)).digest(size)


@pytest.mark.parametrize("shared_memory", [True, False])
def test_leading_hits_land_in_their_destinations(daemon: Daemon, shared_memory: bool) -> None:
    with daemon.client(shared_memory=shared_memory) as c:
        assert c.uses_shared_memory is shared_memory
        transfer = ChunkTransfer(c, NAMESPACE, CHUNK, max_batch_keys=2)  # several batches
        stored = [0, 1, 2, 4]  # 3 is a hole
        assert transfer.put([key(i) for i in stored], [payload(i) for i in stored]) == 4
        out = [bytearray(CHUNK) for _ in range(5)]
        assert transfer.get_prefix_into([key(i) for i in range(5)], out) == 3
        assert [bytes(b) for b in out[:3]] == [payload(i) for i in range(3)]
        assert out[3] == bytearray(CHUNK) and out[4] == bytearray(CHUNK)  # nothing past the hole


def test_a_chunk_of_the_wrong_size_ends_the_prefix_and_frees_its_lease(daemon: Daemon) -> None:
    torch = pytest.importorskip("torch")
    with daemon.client() as c:
        assert c.uses_shared_memory
        c.put([key(0), key(1), key(2)], [payload(0), payload(1, CHUNK // 2), payload(2)])
        transfer = ChunkTransfer(c, NAMESPACE, CHUNK)
        out = [torch.zeros(CHUNK, dtype=torch.uint8) for _ in range(3)]
        assert transfer.get_prefix_into([key(0), key(1), key(2)], out) == 1
        assert bytes(out[0].numpy()) == payload(0)
        assert not out[1].any() and not out[2].any()
        shm: dict[str, Any] = c.stats()["shm"]
        assert shm["active_read_leases"] == 0  # released at once, not left to expire
        assert transfer.errors == 0


def test_an_unreachable_daemon_is_a_miss(daemon: Daemon) -> None:
    with daemon.client(fail_open=True, timeout_s=0.5) as c:
        transfer = ChunkTransfer(c, NAMESPACE, CHUNK)
        assert transfer.put([key(0)], [payload(0)]) == 1
        daemon.kill()
        out = [bytearray(CHUNK)]
        assert transfer.get_prefix_into([key(0)], out) == 0
        assert out[0] == bytearray(CHUNK)
    with pytest.raises(ValueError):
        transfer.get_prefix_into([key(0)], [])
