"""The write queue's pool leases under random sequences (a hypothesis state machine).

Writes sent from the pool (the Mooncake tier's puts) hold the pool's lease of their
chunk while they are queued; the lease must be given back exactly once: when the write
leaves the queue (written, dropped, deleted, cleared) or the tier stops, and never
while its header is still being built off the loop (the builder reads the chunk).
A lease given back twice would let the pool free a slot another read holds; one
never given back pins the slot for good.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from lmcache_server.storage.base import ChunkKey
from lmcache_server.storage.remote.queue import Write, WriteQueue

NAMESPACES = ("a", "b")
KEYS = [ChunkKey(ns, bytes([i]) * 32) for ns in NAMESPACES for i in range(3)]
keys = st.sampled_from(KEYS)


class Lease:
    def __init__(self) -> None:
        self.released = 0
        self.reading = False  # a builder reads the chunk now

    def release(self) -> None:
        assert not self.reading, "a lease was given back while its header was being built"
        self.released += 1


class WriteQueueModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.queue = WriteQueue(max_bytes=1 << 30)
        self.leases: list[Lease] = []
        self.writes: dict[int, tuple[Write, Lease]] = {}  # id(write) -> (write, its lease)
        self.building: list[Write] = []
        self.stopped = False

    @rule(key=keys)
    def enqueue(self, key: ChunkKey) -> None:
        lease = Lease()
        self.leases.append(lease)
        write = self.queue.add(key, 100, lease.release)
        if write is None:  # already queued: the caller gives its lease back itself
            lease.release()
            return
        write.building = True
        lease.reading = True
        self.writes[id(write)] = (write, lease)
        self.building.append(write)

    @rule(data=st.data())
    def header_built(self, data: st.DataObject) -> None:
        if not self.building:
            return
        write = self.building.pop(data.draw(st.integers(0, len(self.building) - 1)))
        self.writes[id(write)][1].reading = False
        self.queue.built(write, (bytearray(b"h"), memoryview(b"p")))

    @rule(data=st.data(), stored=st.booleans())
    def sent(self, data: st.DataObject, stored: bool) -> None:
        batch = self.queue.heads(4, 1 << 30)
        if not batch:
            return
        for write in batch[: data.draw(st.integers(1, len(batch)))]:
            if stored:
                self.queue.done(write)

    @rule(key=keys)
    def delete(self, key: ChunkKey) -> None:
        self.queue.cancel(key)

    @rule(namespace=st.sampled_from([*NAMESPACES, None]))
    def clear(self, namespace: str | None) -> None:
        self.queue.cancel_namespace(namespace)

    @rule()
    def stop(self) -> None:
        for write in self.building:  # the tier's close cancels the builders first
            self.writes[id(write)][1].reading = False
            self.queue.abandoned(write)
        self.building.clear()
        self.queue.release_all()
        self.stopped = True

    @invariant()
    def each_lease_given_back_once_and_only_when_free(self) -> None:
        queued = {id(w) for w in self.queue._writes.values()}
        for wid, (_, lease) in self.writes.items():
            assert lease.released <= 1
            if wid in queued and not self.stopped:
                assert lease.released == 0, "a queued write lost its lease"
            elif wid not in queued and not lease.reading:
                assert lease.released == 1, "a write left the queue and kept its lease"
        assert all(lease.released <= 1 for lease in self.leases)


def test_write_queue_leases_model() -> None:
    run_state_machine_as_test(
        WriteQueueModel, settings=settings(max_examples=300, stateful_step_count=40, deadline=None)
    )
