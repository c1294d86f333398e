"""``POST /query`` and the chunks only the shared Redis tier holds for this node
(docs/events.md, "Query"): the prefix goes on through them, counted as ``REMOTE``
(the events' locality), and stops once the node learns Redis dropped one.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import redis

from lmcache_client.keys import chunk_keys, chunk_tokens
from lmcache_client.protocol import PutStatus

from ..conftest import Daemon, RedisServer
from .test_events import CHUNK, NS, prompt, quiet
from .test_events_query import post
from .test_events_remote import MiB, put_then_evict, r, redis_key, remote_daemon  # noqa: F401 - r: a fixture


def test_the_query_counts_chunks_only_redis_holds_as_remote(
    daemon_factory: Callable[..., Daemon],
    redis_server: RedisServer,
    r: redis.Redis,  # noqa: F811
) -> None:
    """``POST /query`` follows the prefix through the chunks this node knows Redis
    holds (``REMOTE``), as the events announce them; none once they are forgotten."""
    daemon = remote_daemon(daemon_factory, redis_server)
    tokens = prompt(37, 3)
    with daemon.client(namespace=NS) as c:
        keys = put_then_evict(c, r, tokens[: 2 * CHUNK])
        quiet(c, remote_moved_chunks=2)
        third = chunk_keys(tokens, CHUNK)[2]
        assert c.put([third], [os.urandom(MiB)], tokens=[chunk_tokens(tokens, CHUNK)[2]]) == [PutStatus.STORED]
        assert c.lookup([*keys, third]).tiers == ["redis", "redis", "memory"]
        status, answer = post(daemon, {"tokens": tokens, "namespace": NS})
        assert status == 200
        assert answer["best"]["prefix_tokens"] == 3 * CHUNK
        assert answer["best"]["by_medium"] == {"REMOTE": 2 * CHUNK, "CPU": CHUNK}
        r.delete(redis_key(keys[1]))
        c.get([keys[1]])  # a miss in Redis: forgotten (and announced removed)
        status, answer = post(daemon, {"tokens": tokens, "namespace": NS})
        assert answer["best"]["prefix_tokens"] == CHUNK and answer["best"]["by_medium"] == {"REMOTE": CHUNK}
