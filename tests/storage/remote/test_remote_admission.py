"""``remote_admission: reused`` through real daemons and a real redis-server (issue #27
item 6): a chunk stored on one daemon reaches the other through Redis only once it
was read (or put again) on the first; until then the first serves it from memory."""

from __future__ import annotations

import os

import redis

from lmcache_client import PutStatus
from lmcache_client.protocol import KEY_BYTES

from ...conftest import RedisServer, wait_for
from .test_redis_tier import drained, remote


def test_reused_chunks_reach_another_daemon_through_redis(daemon_factory, redis_server: RedisServer) -> None:  # type: ignore[no-untyped-def]
    a = daemon_factory(remote_url=redis_server.url, remote_admission="reused")
    b = daemon_factory(remote_url=redis_server.url)
    keys = [os.urandom(KEY_BYTES) for _ in range(3)]
    data = [os.urandom(300_000) for _ in keys]
    read, put_twice, once = keys
    with a.client() as ca, b.client() as cb:
        assert ca.put(keys, data) == [PutStatus.STORED] * 3
        wait_for(drained(a))
        assert redis.Redis(port=redis_server.port).dbsize() == 0  # nothing reused yet: nothing written
        assert cb.lookup(keys).hit_chunks == 0
        assert bytes(ca.get([read])[0]) == data[0]  # served from memory, and now reused
        assert ca.put([put_twice], [data[1]]) == [PutStatus.EXISTS]  # a second replica's put
        wait_for(drained(a))
        assert cb.lookup(keys).tiers[:2] == ["redis", "redis"]
        assert [bytes(g) for g in cb.get(keys[:2])] == data[:2]
        assert cb.get([once]) == [None]  # put once, never read: not in Redis
        stats = remote(ca)
        assert stats["admission"] == "reused"
        assert (stats["admitted"], stats["declined"]) == (2, 0)  # once is still in a's memory: not declined yet
        assert bytes(ca.get([once])[0]) == data[2]  # served from a's memory; read: admitted now
        wait_for(drained(a))
        assert remote(ca)["admitted"] == 3
        assert bytes(cb.get([once])[0]) == data[2]
