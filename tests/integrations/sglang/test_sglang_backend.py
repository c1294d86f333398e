"""SGLang HiCache storage backend with stand-ins: real daemon, SGLang-shaped pages.

These run in the main venv, without SGLang.  ``HiCacheStorageConfig`` and the
host KV pool are stand-ins with the fields and page methods of SGLang
0.5.23's own classes (an MHA pool ``kv_buffer`` of ``(2, layers, tokens,
heads, head_dim)`` in the ``layer_first`` layout, flat pages of ``(2, layers,
page_size, heads, head_dim)``; an MLA pool of ``(layers, tokens, 1,
kv_cache_dim)``).  The calls follow SGLang's cache controller:
``batch_exists`` for the hit length, ``batch_get`` into dummy pages then
``set_from_flat_data_page``, and ``batch_set`` of ``get_data_page`` pages.
SGLang's real classes, controller and every host layout: test_sglang_real.py.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lmcache_client.integrations.sglang.hicache import (  # noqa: E402
    HiCacheStorage,
    LMCacheServerHiCacheStorage,
    page_key,
)

from ...conftest import Daemon  # noqa: E402

PAGE, LAYERS, HEADS, HEAD_DIM = 4, 3, 2, 8


def storage_config(**overrides: Any) -> Any:
    """HiCacheStorageConfig's fields, as SGLang fills them."""
    fields: dict[str, Any] = dict(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name="test/sglang-model",
        tp_lcm_size=None,
        should_split_heads=False,
        dp_rank=0,
        extra_config=None,
        dcp_size=1,
        dcp_rank=0,
        logical_page_size=None,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


class MHAHostPool:
    """SGLang's MHATokenToKVPoolHost in the layer_first layout, reduced to what storage uses."""

    layout = "layer_first"

    def __init__(self, size: int, dtype: Any = torch.float16):
        self.page_size, self.layer_num, self.head_num, self.head_dim, self.dtype = PAGE, LAYERS, HEADS, HEAD_DIM, dtype
        self.kv_buffer = torch.zeros(2, LAYERS, size, HEADS, HEAD_DIM, dtype=dtype)

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        page = self.kv_buffer[:, :, index : index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> Any:
        return torch.zeros(2, LAYERS, self.page_size, HEADS, HEAD_DIM, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: Any) -> None:
        shape = (2, LAYERS, self.page_size, HEADS, HEAD_DIM)
        self.kv_buffer[:, :, index : index + self.page_size] = data_page.reshape(shape)


class MLAHostPool:
    """SGLang's MLATokenToKVPoolHost (layer_first): one latent vector per token and layer."""

    layout = "layer_first"

    def __init__(self, size: int, kv_cache_dim: int = 24):
        self.page_size, self.layer_num, self.kv_cache_dim, self.dtype = PAGE, LAYERS, kv_cache_dim, torch.bfloat16
        self.kv_buffer = torch.zeros(LAYERS, size, 1, kv_cache_dim, dtype=self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        page = self.kv_buffer[:, index : index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> Any:
        return torch.zeros(LAYERS, self.page_size, 1, self.kv_cache_dim, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: Any) -> None:
        self.kv_buffer[:, index : index + self.page_size] = data_page.reshape(LAYERS, self.page_size, 1, -1)


def page_hashes(tokens: list[int]) -> list[str]:
    """A hex hash chain over full pages, shaped like SGLang's page hashes."""
    out, prior = [], ""
    for start in range(0, len(tokens) - PAGE + 1, PAGE):
        h = hashlib.sha256(prior.encode() + bytes(str(tokens[start : start + PAGE]), "ascii")).hexdigest()
        out.append(h)
        prior = h
    return out


class Replica:
    """One SGLang rank: its host pool and its storage backend, built as SGLang builds them."""

    def __init__(self, address: str, pool: Any = None, **config: Any):
        extra = {
            "backend_name": "lmcache-server",
            "module_path": "lmcache_client.integrations.sglang.hicache",
            "class_name": "LMCacheServerHiCacheStorage",
            "address": address,
            "timeout_s": 5.0,
        }
        extra.update(config.pop("extra", {}))
        self.pool = pool if pool is not None else MHAHostPool(64)
        self.backend = LMCacheServerHiCacheStorage(storage_config(extra_config=extra, **config), {})
        self.backend.register_mem_pool_host(self.pool)

    def fill(self, seed: int) -> None:
        """Random KV in every host slot."""
        g = torch.Generator().manual_seed(seed)
        self.pool.kv_buffer.copy_(torch.randn(self.pool.kv_buffer.shape, generator=g))

    def backup(self, keys: list[str], first_slot: int) -> bool:
        """The controller's generic page set."""
        pages = [self.pool.get_data_page(first_slot + i * PAGE) for i in range(len(keys))]
        return bool(self.backend.batch_set(keys, pages))

    def prefetch(self, keys: list[str], first_slot: int) -> int:
        """The controller's hit query + generic page get; returns pages loaded."""
        hits = self.backend.batch_exists(keys)
        got = self.backend.batch_get(keys[:hits], [self.pool.get_dummy_flat_data_page() for _ in keys[:hits]])
        loaded = 0
        for i, page in enumerate(got):
            if page is None:
                break
            self.pool.set_from_flat_data_page(first_slot + i * PAGE, page)
            loaded += 1
        return loaded


@pytest.fixture(scope="module")
def shared_daemon(module_daemon_factory: Callable[..., Daemon]) -> Daemon:
    return module_daemon_factory()


@pytest.fixture
def replicas(shared_daemon: Daemon, request: pytest.FixtureRequest) -> Iterator[Any]:
    """Replicas on the module's daemon, in a tenant of the test's own."""
    made: list[Replica] = []

    def make(address: str = shared_daemon.address, **kwargs: Any) -> Replica:
        kwargs.setdefault("extra", {}).setdefault("tenant", request.node.name)
        made.append(Replica(address, **kwargs))
        return made[-1]

    yield make
    for replica in made:
        replica.backend.close()


def test_pages_written_by_one_rank_are_read_by_another_replica(replicas: Any) -> None:
    a, b = replicas(), replicas()
    a.fill(seed=1)
    keys = page_hashes(list(range(24)))
    assert a.backup(keys, first_slot=8)
    assert b.prefetch(keys, first_slot=20) == 6  # lands at other host slots
    src = a.pool.kv_buffer[:, :, 8 : 8 + 24]
    assert torch.equal(b.pool.kv_buffer[:, :, 20 : 20 + 24], src)
    assert torch.count_nonzero(b.pool.kv_buffer[:, :, :20]) == 0


def test_batch_exists_counts_leading_pages_only(replicas: Any) -> None:
    r = replicas()
    r.fill(seed=2)
    keys = page_hashes(list(range(100, 124)))
    assert r.backend.batch_exists(keys) == 0 and r.backend.batch_exists([]) == 0
    assert r.backup(keys[:3], 0) and r.backup(keys[4:5], 16)
    assert r.backend.batch_exists(keys) == 3
    assert [r.backend.exists(k) for k in keys] == [True, True, True, False, True, False]
    assert r.backend.get(keys[5], r.pool.get_dummy_flat_data_page()) is None
    page = r.backend.get(keys[1])  # no target: a fresh page from the pool's dummy
    assert page is not None and torch.equal(page, r.pool.get_data_page(PAGE))
    got = r.backend.batch_get(keys, [r.pool.get_dummy_flat_data_page() for _ in keys])
    assert [g is not None for g in got] == [True, True, True, False, False, False]  # leading run


def test_namespace_holds_model_rank_layout_and_mla(replicas: Any, request: pytest.FixtureRequest) -> None:
    rank0 = replicas(tp_rank=0, tp_size=2)
    rank1 = replicas(tp_rank=1, tp_size=2)
    tenant = request.node.name
    assert (
        rank0.backend.namespace
        == f"test/sglang-model|float16|L3|KV2|D8|tp0of2|c4|layout=sglang-layer_first|tenant={tenant}"
    )
    rank0.fill(seed=3)
    keys = page_hashes(list(range(8)))
    assert rank0.backup(keys, 0)
    assert rank1.backend.batch_exists(keys) == 0, "TP shards must not share pages"
    other_model = replicas(model_name="other/model")
    assert other_model.backend.batch_exists(keys) == 0

    mla0 = replicas(pool=MLAHostPool(32), tp_rank=0, tp_size=2, is_mla_model=True)
    mla1 = replicas(pool=MLAHostPool(32), tp_rank=1, tp_size=2, is_mla_model=True)
    assert mla0.backend.namespace == (
        f"test/sglang-model|bfloat16|L3|KV1|D24|tp0of1|c4|layout=sglang-mla-layer_first|tenant={tenant}"
    )
    mla0.fill(seed=6)
    assert mla0.backup(keys, 4)
    assert mla1.prefetch(keys, 12) == 2, "MLA KV is the same on every rank: one shared namespace"
    assert torch.equal(mla1.pool.kv_buffer[:, 12:20], mla0.pool.kv_buffer[:, 4:12])


def test_bfloat16_pages_round_trip(replicas: Any) -> None:
    a, b = replicas(pool=MHAHostPool(32, torch.bfloat16)), replicas(pool=MHAHostPool(32, torch.bfloat16))
    a.fill(seed=7)
    keys = page_hashes(list(range(500, 516)))
    assert a.backup(keys, 0) and b.prefetch(keys, 0) == 4
    assert torch.equal(a.pool.kv_buffer[:, :, :16], b.pool.kv_buffer[:, :, :16])
    assert "|bfloat16|" in (a.backend.namespace or "")


def test_sizes_that_do_not_fit_are_refused(replicas: Any, shared_daemon: Daemon) -> None:
    r = replicas()
    keys = page_hashes(list(range(8)))
    assert r.backend.set(keys[0], torch.zeros(10, dtype=torch.float16)) is False
    assert r.backend.set(keys[0], None) is False
    assert r.backend.batch_set(keys, [r.pool.get_data_page(0)]) is False  # count mismatch
    with shared_daemon.client() as raw:  # a page of the wrong size stored by someone else
        raw.put([page_key(keys[0])], [b"\x01" * 40], namespace=r.backend.namespace)
    assert r.backend.get(keys[0], r.pool.get_dummy_flat_data_page()) is None
    assert r.backend.batch_get(keys[:1], [torch.zeros(3, dtype=torch.float16)]) == [None]


def test_clear_removes_this_namespace_only(replicas: Any) -> None:
    a, other = replicas(), replicas(model_name="other/model")
    a.fill(seed=4)
    other.fill(seed=5)
    keys = page_hashes(list(range(1000, 1008)))
    assert a.backup(keys, 0) and other.backup(keys, 0)
    assert a.backend.clear() is True
    assert a.backend.batch_exists(keys) == 0 and other.backend.batch_exists(keys) == 2


def test_concurrent_threads_use_their_own_clients(replicas: Any) -> None:
    r = replicas(pool=MHAHostPool(256))
    r.fill(seed=8)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            keys = page_hashes(list(range(t * 1000, t * 1000 + 32)))
            assert r.backup(keys, t * 32)
            for _ in range(5):
                got = r.backend.batch_get(keys, [r.pool.get_dummy_flat_data_page() for _ in keys])
                for i, page in enumerate(got):
                    assert page is not None and torch.equal(page, r.pool.get_data_page(t * 32 + i * PAGE))
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    assert len(r.backend._clients) == 4


def test_daemon_down_is_a_miss(replicas: Any, daemon: Daemon) -> None:
    r = replicas(daemon.address, extra={"timeout_s": 0.3})
    keys = page_hashes(list(range(8)))
    daemon.kill()
    assert r.backend.batch_exists(keys) == 0
    assert r.backend.exists(keys[0]) is False
    assert r.backend.batch_get(keys, [r.pool.get_dummy_flat_data_page() for _ in keys]) == [None, None]
    assert r.backend.batch_set(keys, [r.pool.get_data_page(0), r.pool.get_data_page(4)]) is False
    assert r.backend.clear() is False


def test_construction_as_sglang_does_it(shared_daemon: Daemon) -> None:
    assert issubclass(LMCacheServerHiCacheStorage, HiCacheStorage)
    with pytest.raises(ValueError, match="unknown hicache storage extra config keys \\['adress'\\]"):
        LMCacheServerHiCacheStorage(storage_config(extra_config={"adress": "tcp://x:1"}), {})
    with pytest.raises(ValueError, match="model"):
        LMCacheServerHiCacheStorage(storage_config(model_name=None), {})
    with pytest.raises(ValueError, match="'malloc_tuning': expected true or false, got 'no'"):
        LMCacheServerHiCacheStorage(storage_config(extra_config={"malloc_tuning": "no"}), {})
    LMCacheServerHiCacheStorage(storage_config(extra_config={"malloc_tuning": False}), {})
    backend = LMCacheServerHiCacheStorage(storage_config(extra_config={"address": shared_daemon.address}), {})
    with pytest.raises(RuntimeError, match="register_mem_pool_host"):
        backend.batch_exists(["x"])
    assert page_key("abc") == hashlib.sha256(b"lmcache-sglang-page-v1abc").digest()


def test_pipeline_stages_and_context_parallel_ranks_get_their_own_namespace(replicas: Any) -> None:
    stage0, stage1 = replicas(pp_rank=0, pp_size=2), replicas(pp_rank=1, pp_size=2)
    cp1 = replicas(attn_cp_rank=1, attn_cp_size=2)
    assert "|layout=sglang-layer_first-pp0of2|" in (stage0.backend.namespace or "")
    assert "|layout=sglang-layer_first-cp1of2|" in (cp1.backend.namespace or "")
    stage0.fill(seed=9)
    keys = page_hashes(list(range(2000, 2008)))
    assert stage0.backup(keys, 0)
    assert stage1.backend.batch_exists(keys) == 0 and cp1.backend.batch_exists(keys) == 0, "other layers, same hashes"


def test_side_pools_other_than_mamba_and_swa_are_refused(replicas: Any) -> None:
    r = replicas()
    r.backend.register_mem_host_pool_v2(r.pool, "kv")
    with pytest.raises(ValueError, match="stores only the KV, Mamba and SWA pools, not SGLang's indexer pool"):
        r.backend.register_mem_host_pool_v2(MHAHostPool(32), "indexer")
    with pytest.raises(ValueError, match="decode context parallelism"):
        LMCacheServerHiCacheStorage(storage_config(dcp_size=2, is_mla_model=True), {})


def test_the_old_module_path_still_loads_the_backend() -> None:
    """SGLang configs written before the move name ``integrations.sglang_hicache``."""
    import importlib

    import lmcache_client.integrations.sglang as room

    old = importlib.import_module("lmcache_client.integrations.sglang_hicache")
    assert old.LMCacheServerHiCacheStorage is LMCacheServerHiCacheStorage is room.LMCacheServerHiCacheStorage


def test_side_pool_hit_policies() -> None:
    """SGLang's all_pages and trailing_pages over which of the KV prefix's pages a side pool
    holds (the usable prefix lengths, in pages); other policies are refused."""
    from lmcache_client.integrations.sglang.pools import restorable_prefixes

    held = [True, False, True, True, False, True]
    assert restorable_prefixes(held, "all_pages", 0, 6) == {1}
    assert restorable_prefixes([True] * 3, "all_pages", 0, 3) == {1, 2, 3}
    assert restorable_prefixes(held, "trailing_pages", 1, 6) == {1, 3, 4, 6}  # a state at the end of each
    # the last two pages of a prefix (a one-page prefix has only one)
    assert restorable_prefixes(held, "trailing_pages", 2, 6) == {1, 4}
    assert restorable_prefixes(held, "trailing_pages", 0, 6) == {1, 3, 4, 6}  # at least the last page
    assert restorable_prefixes(held, "trailing_pages", 1, 2) == {1}  # only the KV prefix counts
    with pytest.raises(ValueError, match="hit policy 'block_groups' is not supported"):
        restorable_prefixes(held, "block_groups", 1, 6)
