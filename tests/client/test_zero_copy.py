"""put_with / get_with: callers write and read the bytes in place (pool slots over
shared memory, buffers over frames), against the real daemon."""

from __future__ import annotations

import os
from typing import Any

import pytest

from lmcache_client import PutStatus
from lmcache_client.protocol import KEY_BYTES

from ..conftest import Daemon

MiB = 1 << 20


@pytest.fixture(params=[True, False], ids=["shm", "frames"])
def shared_memory(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def test_put_with_fills_in_place_and_get_with_reads_in_place(daemon: Daemon, shared_memory: bool) -> None:
    keys = [os.urandom(KEY_BYTES) for _ in range(4)]
    data = [os.urandom(MiB + i) for i in range(4)]
    filled: list[int] = []

    def filler(batch: list[bytes]) -> Any:
        def fill(i: int, view: memoryview) -> None:
            assert not view.readonly and view.nbytes == len(batch[i])
            view[:] = batch[i]
            filled.append(i)

        return fill

    with daemon.client(shared_memory=shared_memory) as c:
        assert c.uses_shared_memory == shared_memory
        assert c.put_with(keys[:3], [len(d) for d in data[:3]], filler(data[:3])) == [PutStatus.STORED] * 3
        assert filled == [0, 1, 2]
        # An existing key needs no bytes: fill is not called for it.
        filled.clear()
        statuses = c.put_with(keys[2:], [len(d) for d in data[2:]], filler(data[2:]))
        assert statuses == [PutStatus.EXISTS, PutStatus.STORED]
        assert filled == ([1] if shared_memory else [0, 1])  # frames fill before the daemon answers

        seen: dict[int, bytes] = {}
        hits = c.get_with(keys, lambda i, view: seen.__setitem__(i, bytes(view)))
        assert hits == [True] * 4 and all(seen[i] == data[i] for i in range(4))

        # nbytes: a chunk of another size is a miss; prefix: nothing after the first miss.
        missing = os.urandom(KEY_BYTES)
        seen.clear()
        hits = c.get_with([keys[0], missing, keys[1]], lambda i, v: seen.__setitem__(i, bytes(v)))
        assert hits == [True, False, True]
        seen.clear()
        assert c.get_with([keys[0], missing, keys[1]], lambda i, v: None, prefix=True) == [True, False, False]
        assert c.get_with(keys[:2], lambda i, v: None, nbytes=MiB) == [True, False]
        assert c.get_with(keys[:3], lambda i, v: None, nbytes=MiB, prefix=True) == [True, False, False]


def test_a_failing_fill_stores_nothing(daemon: Daemon, shared_memory: bool) -> None:
    keys = [os.urandom(KEY_BYTES) for _ in range(2)]

    def fill(i: int, view: memoryview) -> None:
        if i == 1:
            raise RuntimeError("device error")
        view[:] = b"\x01" * view.nbytes

    with daemon.client(shared_memory=shared_memory) as c:
        before = c.stats()["tiers"]["memory"]
        with pytest.raises(RuntimeError, match="device error"):
            c.put_with(keys, [MiB, MiB], fill)
        assert c.exists(keys) == [False, False]
        if shared_memory:  # the reserved slots were released at once, not at the lease's end
            stats: dict[str, Any] = c.stats()
            assert stats["tiers"]["memory"]["allocated_bytes"] == before["allocated_bytes"]
        assert (
            c.put_with(keys, [MiB, MiB], lambda i, v: v.__setitem__(slice(None), b"\x02" * v.nbytes))
            == [PutStatus.STORED] * 2
        )
        assert [bytes(b) for b in c.get(keys)] == [b"\x02" * MiB] * 2


def test_a_failing_use_releases_the_lease(daemon: Daemon) -> None:
    key = [os.urandom(KEY_BYTES)]
    with daemon.client() as c:
        c.put(key, [os.urandom(MiB)])

        def use(i: int, view: memoryview) -> None:
            raise ValueError("bad chunk")

        with pytest.raises(ValueError):
            c.get_with(key, use)
        assert c.delete(key) == [True]  # not held by a leaked lease
