"""Round trips through the real daemon: sizes, batches, transports, both clients."""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from lmcache_client import AsyncCacheClient, CacheClient, ErrorCode, Namespace, PutStatus, ServerError, chunk_keys
from lmcache_client.protocol import KEY_BYTES

from ..conftest import NAMESPACE, Daemon


def rand_keys(n: int) -> list[bytes]:
    return [os.urandom(KEY_BYTES) for _ in range(n)]


@pytest.mark.parametrize("size", [1, 100, 4095, 4096, 4097, 65535, 65536, 65537, 1 << 20, 3 * (1 << 20) + 7])
def test_put_get_sizes(client: CacheClient, size: int) -> None:
    key = rand_keys(1)
    data = os.urandom(size)
    assert client.put(key, [data]) == [PutStatus.STORED]
    [got] = client.get(key)
    assert got is not None and bytes(got) == data


def test_batch_ops(client: CacheClient) -> None:
    keys = rand_keys(16)
    payloads = [os.urandom(random.randint(1, 200_000)) for _ in keys]
    assert client.put(keys, payloads) == [PutStatus.STORED] * 16
    # Idempotent: a second put of the same keys writes nothing.
    assert client.put(keys, payloads) == [PutStatus.EXISTS] * 16
    missing = rand_keys(2)
    got = client.get([keys[0], missing[0], *keys[1:], missing[1]])
    assert got[1] is None and got[-1] is None
    assert [bytes(g) for g in got[:1] + got[2:-1] if g is not None] == payloads
    assert client.exists([keys[3], missing[0]]) == [True, False]
    assert client.delete([keys[3], missing[0]]) == [True, False]
    assert client.exists([keys[3]]) == [False]
    stats = client.stats(namespace=NAMESPACE)
    assert stats["namespace"]["chunks"] == 15
    assert stats["namespace"]["stored_bytes"] == sum(map(len, payloads)) - len(payloads[3])


def test_lookup_counts_leading_hits(client: CacheClient) -> None:
    tokens = list(range(100))
    keys = chunk_keys(tokens, 16)  # 6 full chunks; the 4-token tail has no key
    assert len(keys) == 6
    client.put(keys[:2] + keys[3:], [b"x" * 10] * 5)
    result = client.lookup(keys)
    assert result.hit_chunks == 2
    assert result.tiers == ["memory", "memory", None, "memory", "memory", "memory"]
    with pytest.raises(ValueError, match="chunk_size"):
        client.lookup_tokens(tokens)  # the client was given no chunk size


def test_lookup_tokens_with_namespace(daemon: Daemon) -> None:
    ns = Namespace("m", "float16", num_layers=2, num_kv_heads=2, head_dim=8, chunk_size=16)
    with CacheClient(daemon.address, ns, fail_open=False) as c:
        tokens = list(range(50))
        keys = chunk_keys(tokens, 16)
        assert c.lookup_tokens(tokens) == 0
        c.put(keys[:2], [b"a", b"b"])
        assert c.lookup_tokens(tokens) == 32
        c.put(keys[2:], [b"c"])
        assert c.lookup_tokens(tokens) == 48  # never the 2-token tail


def test_namespaces_are_isolated(daemon: Daemon) -> None:
    key = rand_keys(1)
    with daemon.client(namespace="model-a") as a, daemon.client(namespace="model-b") as b:
        a.put(key, [b"from a"])
        assert b.get(key) == [None]
        assert b.lookup(key).hit_chunks == 0
        b.put(key, [b"from b"])
        assert bytes(a.get(key)[0]) == b"from a"
        assert b.clear() == 1
        assert bytes(a.get(key)[0]) == b"from a"


def test_two_clients_share_chunks_over_tcp_and_ipc(daemon: Daemon) -> None:
    keys = rand_keys(4)
    payloads = [os.urandom(300_000) for _ in keys]
    with daemon.client() as writer, daemon.client(address=daemon.ipc_address) as reader:
        assert writer.put(keys, payloads) == [PutStatus.STORED] * 4
        assert [bytes(x) for x in reader.get(keys)] == payloads
        assert reader.lookup(keys).hit_chunks == 4


def test_pin_protects_from_eviction(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory(max_local_cpu_size="8MiB")
    with daemon.client() as c:
        pinned = rand_keys(1)
        c.put(pinned, [os.urandom(1 << 20)])
        assert c.pin(pinned) == [True]
        assert c.pin(rand_keys(1)) == [False]  # not stored
        for _ in range(30):  # 30 MiB through an 8 MiB pool
            c.put(rand_keys(1), [os.urandom(1 << 20)])
        assert c.exists(pinned) == [True]
        assert c.unpin(pinned) == [True]
        for _ in range(30):
            c.put(rand_keys(1), [os.urandom(1 << 20)])
        assert c.exists(pinned) == [False]


def test_pins_limited_to_fraction(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory(max_local_cpu_size="8MiB", max_pinned_fraction=0.25)
    with daemon.client() as c:
        keys = rand_keys(4)
        c.put(keys, [os.urandom(1 << 20)] * 4)
        with pytest.raises(ServerError) as err:  # over the limit: refused whole (PIN_LIMIT)
            c.pin(keys)
        assert err.value.code == ErrorCode.PIN_LIMIT
        assert c.pin(keys[:2]) == [True, True]
        with pytest.raises(ServerError):
            c.pin(keys[2:3])
        assert c.stats()["tiers"]["memory"]["pinned_bytes"] == 2 << 20


def test_tensors_roundtrip(client: CacheClient) -> None:
    torch = pytest.importorskip("torch")
    keys = rand_keys(3)
    tensors = [torch.randn(2, 16, 2, 64, dtype=dt) for dt in (torch.float32, torch.bfloat16, torch.float16)]
    assert client.put_tensors(keys, tensors) == [PutStatus.STORED] * 3
    outs = [torch.empty_like(t) for t in tensors]
    assert client.get_into(keys, outs) == [True] * 3
    for t, o in zip(tensors, outs):
        assert torch.equal(t, o)
    # Non-contiguous tensors are stored by value, in contiguous order.
    t = torch.randn(8, 8).t()
    k = rand_keys(1)
    client.put_tensors(k, [t])
    out = torch.empty(8, 8)
    client.get_into(k, [out])
    assert torch.equal(out, t.contiguous())


def test_async_client_concurrent(daemon: Daemon) -> None:
    async def main() -> None:
        async with AsyncCacheClient(daemon.address, NAMESPACE, fail_open=False) as c:
            keys = rand_keys(40)
            payloads = [os.urandom(random.randint(1, 300_000)) for _ in keys]
            puts = await asyncio.gather(*[c.put([k], [p]) for k, p in zip(keys, payloads)])
            assert puts == [[PutStatus.STORED]] * 40
            gets = await asyncio.gather(*[c.get([k]) for k in keys])
            assert [bytes(g[0]) for g in gets] == payloads
            assert (await c.lookup(keys)).hit_chunks == 40
            assert await c.delete(keys[:1]) == [True]
            assert (await c.stats())["tiers"]["memory"]["chunks"] == 39
            assert await c.clear() == 39
            assert (await c.hello())["protocol_version"] == 1

    asyncio.run(main())


def test_hello_reports_limits(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory(chunk_size=512, max_keys_per_request=100)
    with daemon.client() as c:
        info = c.hello()
        assert info["protocol_version"] == 1
        assert info["key_bytes"] == 32
        assert info["chunk_size"] == 512
        assert info["max_keys_per_request"] == 100
        assert set(info["ops"]) >= {"put", "get", "lookup", "exists", "delete", "clear", "stats", "ping"}
