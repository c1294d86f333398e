"""Chunks only this node's Redis uplink holds (locality REMOTE, docs/events.md "Media and
locality") as NVIDIA Dynamo's own indexer (ai-dynamo-runtime 1.6.1) takes them.

Dynamo's relay (``convert_event`` in lib/kv-router/src/zmq_wire/convert.rs; its trace
line "Dropping non-local KV event (locality != LOCAL)" is in the 1.6.1 wheel's binary) drops every event whose
``locality`` is ``REMOTE``: it has no consumer for a shared tier yet, so it fails
closed.  What it sees of a move to Redis is the ``BlockRemoved`` ``LOCAL`` (the node
no longer holds the block locally), and of the promotion back the ``BlockStored``
``LOCAL``; the ``BlockRemoved`` ``REMOTE`` that follows is dropped too, so the
promoted blocks stay credited.  Checked against the running indexer below.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from lmcache_client.protocol import PutStatus

from ...conftest import Daemon, RedisServer, wait_for
from .indexer import DynamoIndexer
from .test_dynamo_indexer import CHUNK, MODEL, NS, agree, events_daemon, node_query, prompt, put, register


def test_dynamo_drops_remote_events_and_credits_the_chunks_promoted_back(
    daemon_factory: Callable[..., Daemon], dynamo_indexer: DynamoIndexer, redis_server: RedisServer
) -> None:
    daemon = events_daemon(
        daemon_factory, max_local_cpu_size="4MiB", remote_url=redis_server.url, events_remote_audit_s=0
    )
    register(dynamo_indexer, daemon, 7)
    a = prompt(7, 2 * CHUNK)
    with daemon.client(namespace=NS, chunk_size=CHUNK) as c:
        keys = put(c, a, size=1 << 20)
        assert agree(dynamo_indexer, daemon, c, a, instance=7) == (2 * CHUNK, 2 * CHUNK)
        wait_for(lambda: c.stats()["events"]["remote_known_chunks"] >= 2)  # Redis acknowledged both
        for _ in range(6):  # token-less fillers push A out of memory; Redis still holds it
            assert c.put([os.urandom(32)], [os.urandom(1 << 20)]) == [PutStatus.STORED]
        wait_for(lambda: c.lookup(keys).tiers == ["redis", "redis"])
        wait_for(lambda: (s := c.stats()["events"])["remote_moved_chunks"] == 2 and s["pending_events"] == 0)
        # Announced REMOTE: Dynamo drops those events and applies the BlockRemoved LOCAL.
        wait_for(lambda: dynamo_indexer.longest(MODEL, a, 7) == 0)
        # POST /query counts them REMOTE (the same knowledge as the events): what Dynamo dropped.
        answer = node_query(daemon, a)
        assert answer["prefix_tokens"] == 2 * CHUNK and answer["by_medium"] == {"REMOTE": 2 * CHUNK}
        assert c.lookup_tokens(a) == 2 * CHUNK  # the daemon still serves A, from Redis
        for key in keys:  # in order: B's first block chains to A's last
            [data] = c.get([key])
            assert data is not None
        # Promoted: BlockStored LOCAL (taken), then BlockRemoved REMOTE (dropped: A stays).
        wait_for(lambda: c.stats()["events"]["moved_chunks"] == 4)
        assert agree(dynamo_indexer, daemon, c, a, instance=7) == (2 * CHUNK, 2 * CHUNK)
        assert dynamo_indexer.overlap(MODEL, a)[7]["cpu"] == 2 * CHUNK
