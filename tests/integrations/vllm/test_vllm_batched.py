"""Loads in batches (``batch_copies``, integrations/batched.py): each daemon round trip's
chunks go into the cache in one copier call while their leases are held, through the
stand-in engine on a real daemon.  On CPU ``auto`` keeps chunk-by-chunk copies; ``on``
forces the batched path the CUDA workers take, so its bytes are checked here."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lmcache_client import CacheClient, PutStatus, chunk_keys  # noqa: E402
from lmcache_client.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from lmcache_client.protocol import KEY_BYTES  # noqa: E402

from .vllm_harness.engine import LAYERS, Engine, Request, expected_rows  # noqa: E402

PROMPT = list(range(6000, 6000 + 8 * 12 + 3))  # 12 full chunks of 8 and a tail of 3


def test_a_batched_load_writes_exactly_the_chunks_bytes(engines: Callable[..., Engine]) -> None:
    a, b = engines(), engines(batch_copies="on", store_tails=True)
    assert a.worker.worker is not None and a.worker.worker.cache.batches is None  # type: ignore[union-attr]  # auto on a CPU: chunk by chunk
    a.prefill("a", PROMPT)
    copies = b.worker.worker.cache  # type: ignore[union-attr]
    assert copies is not None and copies.batches is not None
    run = b.prefill("b", PROMPT)
    assert run["external"] == 8 * 12 and run["computed"] == list(range(96, len(PROMPT)))
    for layer in range(LAYERS):
        assert torch.equal(b.rows(run["blocks"], 0, 96, layer), expected_rows(PROMPT, 0, 96, layer, torch.float16))
    assert 1 <= copies.launches < 12, "one copier call per daemon batch, not one per chunk"
    assert not b.load_errors


def test_a_batched_load_stops_at_a_missing_chunk_and_keeps_the_prefix(
    engines: Callable[..., Engine], address: str
) -> None:
    a, b = engines(), engines(batch_copies="on")
    a.prefill("a", PROMPT)
    request_keys = chunk_keys(PROMPT, 8)
    ns = b.worker.worker.transfer.namespace  # type: ignore[union-attr]
    request = Request("b", PROMPT)
    assert b.ask(request) == 96  # the lookup sees all 12 chunks; one goes before the load reads it
    with CacheClient(address, fail_open=False) as c:
        assert c.delete([request_keys[7]], namespace=ns) == [True]
    blocks = b.alloc(len(PROMPT))
    b.scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: (blocks,)), 96)
    b.until(lambda: "b" in b.finished_recving, "load of b")
    for layer in range(LAYERS):  # the 7 chunks before the hole are exact
        assert torch.equal(b.rows(blocks, 0, 56, layer), expected_rows(PROMPT, 0, 56, layer, torch.float16))
    failed = sorted(b.load_errors)
    assert failed and set(failed) <= set(blocks[56 // b.block_size :]), "only blocks from the hole on are recomputed"
    assert set(blocks[56 // b.block_size : 96 // b.block_size]) <= set(failed)


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_batched_save_stores_exactly_the_gathered_bytes(
    engines: Callable[..., Engine], address: str, is_async: bool
) -> None:
    """Saves batch too: each daemon batch of a save's chunks is gathered by one copier call,
    before the batch's commit (the fill's ``flush``)."""
    a = engines(batch_copies="on", async_transfers=is_async, store_tails=True)
    plain = engines(async_transfers=is_async, store_tails=True, tenant=f"plain-batched-{is_async}")
    a.prefill("a", PROMPT, step_tokens=20)  # several saves, chunks completed mid-step
    plain.prefill("p", PROMPT, step_tokens=20)
    copies = a.worker.worker.cache  # type: ignore[union-attr]
    assert copies is not None and copies.batches is not None
    with_chunks = sum(1 for meta in a.log for save in meta.saves if save.keys)
    assert copies.launches == with_chunks > 1, "one copier call per save's daemon batch, not one per chunk"
    stored = a.stored(address)
    assert len(stored) == 13 and stored == plain.stored(address), "12 chunks and the tail, byte for byte"


@pytest.mark.parametrize("shared", [True, False], ids=["shm", "frames"])
@pytest.mark.parametrize("staged", [True, False], ids=["staged", "alloc"])
def test_put_with_flushes_a_deferring_fill_before_the_commit(
    daemon_factory: Callable[..., Any], tmp_path: Any, shared: bool, staged: bool
) -> None:
    """A ``fill`` given with a ``flush`` may write its views at flush: once per put, after the
    last fill and before the bytes are committed (shared memory: staged slots or
    alloc+commit) or sent (payload frames); what was written at flush is what is stored."""
    extra = {} if shared else {"shm_dir": str(tmp_path / "nope")}
    daemon = daemon_factory(**extra)
    with daemon.client(staged_puts=staged) as c:
        for _ in range(4):  # later puts of a stream take the staged slots where allowed
            keys = [os.urandom(KEY_BYTES) for _ in range(3)]
            data = [os.urandom(300 * 1024) for _ in keys]  # past PUT_MIN_BYTES: the pool path
            views: dict[int, memoryview] = {}
            flushes: list[int] = []

            def fill(i: int, view: memoryview, views: dict[int, memoryview] = views) -> None:
                views[i] = view  # written later

            def flush(
                views: dict[int, memoryview] = views, data: list[bytes] = data, flushes: list[int] = flushes
            ) -> None:
                flushes.append(len(views))
                for i, view in views.items():
                    view[:] = data[i]

            assert c.put_with(keys, [len(d) for d in data], fill, flush=flush) == [PutStatus.STORED] * 3
            assert c.uses_shared_memory is shared
            assert flushes == [3]
            assert [bytes(v) for v in c.get(keys)] == data  # type: ignore[arg-type]


def test_batch_copies_setting_is_validated() -> None:
    assert ConnectorSettings.from_extra_config({}).batch_copies == "auto"
    assert ConnectorSettings.from_extra_config({"batch_copies": "on"}).batch_copies == "on"
    with pytest.raises(ValueError, match="batch_copies"):
        ConnectorSettings.from_extra_config({"batch_copies": "yes"})


@pytest.mark.parametrize("shared", [True, False], ids=["shm", "frames"])
def test_get_with_flushes_a_deferring_use_before_the_views_go(
    daemon_factory: Callable[..., Any], tmp_path: Any, shared: bool
) -> None:
    """A ``use`` given with a ``flush`` may read its views at flush: once per get, before the
    lease ends (shared memory) or the reply's frames go (a daemon without it)."""
    daemon = daemon_factory() if shared else daemon_factory(shm_dir=str(tmp_path / "nope"))
    keys = [os.urandom(KEY_BYTES) for _ in range(4)]
    data = [os.urandom(4096) for _ in keys]
    with daemon.client() as c:
        assert c.put(keys, data) == [PutStatus.STORED] * 4
        assert c.uses_shared_memory is shared
        seen: dict[int, memoryview] = {}
        flushed: list[dict[int, bytes]] = []

        def use(i: int, view: memoryview) -> None:
            seen[i] = view

        def flush() -> None:
            flushed.append({i: bytes(v) for i, v in seen.items()})

        asked = keys[:2] + [os.urandom(KEY_BYTES)] + keys[2:]  # a miss in the middle: a prefix of 2
        assert c.get_with(asked, use, prefix=True, flush=flush) == [True, True, False, False, False]
        assert flushed == [{0: data[0], 1: data[1]}]
