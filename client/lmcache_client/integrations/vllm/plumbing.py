"""The vLLM connector's clients, transfers and lanes: one blocking client per thread.

A :class:`Plumbing` is built by the connector from its settings, payload
layout, Mamba wiring and role; it makes the clients and transfers each role
uses and keeps every lane (a thread with a client of its own) it made, so the
connector can count their failures and close them.

Primitive: :class:`Plumbing`.
"""

from __future__ import annotations

from typing import Any

from ...client import CacheClient
from ..chunklayout import ChunkLayout
from ..transfer import ChunkTransfer
from .lanes import Lane
from .scheduler import LookupService
from .settings import ConnectorSettings
from .states import StateWiring


class Plumbing:
    """Factories of the connector's clients, transfers and lanes."""

    def __init__(self, settings: ConnectorSettings, layout: ChunkLayout, states: StateWiring | None, kv_role: str):
        self.settings = settings
        self.layout = layout
        self.states = states
        self.kv_role = kv_role
        self.lanes: list[Lane] = []
        """Threads talking to the daemon off vLLM's thread (asynchronous mode)."""

    def state_namespace(self, kv: Any) -> str:
        """The Mamba states' namespace beside the chunks' ``kv`` (:meth:`.mamba.StateLayout.namespace`)."""
        assert self.states is not None
        return self.states.layout.namespace(kv).wire()

    def new_client(self) -> CacheClient:
        s = self.settings
        return CacheClient(
            s.address,
            timeout_s=s.timeout_s,
            copy_threads=s.copy_threads,
            backoff_s=s.backoff_s,
            max_backoff_s=s.max_backoff_s,
            server_public_key=s.server_public_key or None,
            client_secret_key=s.client_secret_key or None,
        )

    def transfer(self, client: CacheClient, namespace: Any) -> ChunkTransfer:
        return ChunkTransfer(
            client,
            namespace,
            self.layout.nbytes,
            codec_layout=self.layout,  # encodes with the codec the daemon announces (docs/codec.md)
            codec=self.settings.codec or None,
        )

    def lane(self, name: str, namespace: Any) -> Lane:
        """A thread with a client of its own (a client is not thread-safe)."""
        lane = Lane(name, self.transfer(self.new_client(), namespace))
        self.lanes.append(lane)
        return lane

    def lookups(self, namespaces: list[Any]) -> LookupService:
        lanes = [self.lane(f"lmcache-lookup-{rank}", ns) for rank, ns in enumerate(namespaces)]
        # A prefetch readies a load; a producer never loads.
        return LookupService(lanes, prefetch=self.settings.prefetch and self.kv_role != "kv_producer")
