"""Property-based fuzzing of the request decoder and of the daemon's socket.

(a) ``decode_request(frames, Limits(...))`` on arbitrary frame lists, on
    msgpack headers whose ``v``/``op``/``id``/``ns``/``keys`` have random types
    and values, and on byte-mutated valid headers: it returns a Request that
    satisfies the protocol's invariants or raises ProtocolError carrying an
    ErrorCode, never anything else.
(b) A real daemon (one per module) fed the same kinds of multipart messages by a
    raw ZeroMQ DEALER: every message gets exactly one reply, never INTERNAL, and
    afterwards the daemon still serves a put/get round trip.

The suite runs a short campaign (a few seconds).  A longer one:

    LMCACHE_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest tests/server/test_fuzz.py -q -s --timeout 0

(``--timeout 0`` lifts pytest-timeout's 120 s per-test limit from pyproject.toml.)

``LMCACHE_FUZZ_EXAMPLES`` sets ``max_examples`` of every test here (default 150
for the decoder tests, a third of it for the socket test); the tests print how
many inputs they tried.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_client import CacheClient
from lmcache_client.protocol import (
    KEY_BYTES,
    MAX_NAMESPACE_BYTES,
    ErrorCode,
    Limits,
    Op,
    ProtocolError,
    Request,
    decode_reply,
    decode_request,
)

from ..conftest import NAMESPACE, Daemon, wait_for

EXAMPLES = int(os.environ.get("LMCACHE_FUZZ_EXAMPLES", "150"))
SOCKET_EXAMPLES = max(20, EXAMPLES // 3)
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    database=None,
)

LIMITS = [
    Limits(),
    Limits(max_header_bytes=4096, max_keys=8, max_message_bytes=64 * 1024),
    Limits(max_header_bytes=64, max_keys=1, max_message_bytes=256),
]
OPS = [op.value for op in Op]
_KEYED = {Op.PUT, Op.GET, Op.LOOKUP, Op.EXISTS, Op.DELETE, Op.PIN, Op.UNPIN, Op.ALLOC}
SEGMENT: dict[str, str] = {"token": "no-segment"}
"""The fuzzed daemon's shared-memory segment (set by the dealer fixture), so that
shared-memory requests get past the segment check and reach their handlers."""
tried = {"decoder": 0, "socket": 0}

# -- strategies ---------------------------------------------------------------------------
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=40)
)
values = st.recursive(
    scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=8
)
keys_values = (
    st.lists(st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES), max_size=10)
    | st.lists(st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES) | st.binary(max_size=40) | scalars, max_size=6)
    | values
)
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "v": st.just(1) | st.just(1) | values,
    "op": st.sampled_from(OPS) | st.sampled_from(OPS) | values,
    "id": st.integers(min_value=0, max_value=2**64 - 1) | values,
    "ns": st.just(NAMESPACE) | st.text(min_size=0, max_size=600) | st.just("x" * 513) | values,
    "keys": keys_values,
    # shared-memory fields (docs/protocol.md 5.12); ignored by the other ops
    "shm": st.builds(lambda: SEGMENT["token"]) | values,
    "sizes": st.lists(st.integers(-2, 1 << 22), max_size=6) | values,
    "lease": st.integers(0, 2**64 - 1) | values,
    "leases": st.lists(st.integers(0, 2**64 - 1) | values, max_size=4) | values,
}


@st.composite
def headers(draw: st.DrawFn) -> dict[str, Any]:
    """A header map with each standard field present (usually) or absent, of random type, plus extras."""
    header: dict[str, Any] = {}
    for name, strategy in FIELDS.items():
        if draw(st.integers(0, 9)) > 0:
            header[name] = draw(strategy)
    header.update(draw(st.dictionaries(st.text(max_size=6), values, max_size=3)))
    return header


@st.composite
def structured_messages(draw: st.DrawFn) -> list[bytes]:
    header = draw(headers())
    data = msgpack.packb(header, use_bin_type=True)
    if draw(st.integers(0, 4)) == 0:  # byte-level mutation of a well-formed header
        raw = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            if not raw:
                break
            i = draw(st.integers(0, len(raw) - 1))
            kind = draw(st.integers(0, 2))
            if kind == 0:
                raw[i] = draw(st.integers(0, 255))
            elif kind == 1:
                del raw[i:]
            else:
                raw[i:i] = draw(st.binary(min_size=1, max_size=4))
        data = bytes(raw)
    keys = header.get("keys")
    n = len(keys) if isinstance(keys, list) else 0
    count = draw(st.sampled_from([n, n, max(0, n - 1), n + 1, 0]))
    payloads = [draw(st.binary(min_size=0, max_size=64)) for _ in range(count)]
    return [data, *payloads]


raw_messages = st.lists(st.binary(max_size=200), min_size=0, max_size=5)
messages = raw_messages | structured_messages() | structured_messages()


# -- (a) the decoder ------------------------------------------------------------------------
def check_decoded(frames: list[bytes], limits: Limits) -> None:
    try:
        req = decode_request(frames, limits)
    except ProtocolError as err:
        assert isinstance(err.code, ErrorCode)
        assert err.code not in (ErrorCode.INTERNAL, ErrorCode.BUSY, ErrorCode.SHUTTING_DOWN)
        assert err.request_id is None or (type(err.request_id) is int and 0 <= err.request_id < 2**64)
        return
    assert isinstance(req, Request)
    assert isinstance(req.op, Op)
    assert type(req.id) is int and 0 <= req.id < 2**64
    assert all(type(k) is bytes and len(k) == KEY_BYTES for k in req.keys)
    assert len(req.keys) <= limits.max_keys
    if req.op in _KEYED or req.namespace is not None:
        if req.op in _KEYED:
            assert req.namespace is not None
        assert isinstance(req.namespace, str) and req.namespace
        assert len(req.namespace.encode()) <= MAX_NAMESPACE_BYTES
    else:
        assert req.keys == ()
    if req.op is Op.PUT:
        assert len(req.payloads) == len(req.keys)
        assert all(memoryview(p).nbytes > 0 for p in req.payloads)
    else:
        assert req.payloads == ()
    assert sum(len(f) for f in frames) <= limits.max_message_bytes
    assert not {"v", "op", "id", "ns", "keys"} & set(req.fields)


@FUZZ
@given(frames=raw_messages, limits=st.sampled_from(LIMITS))
def test_decoder_on_arbitrary_frames(frames: list[bytes], limits: Limits) -> None:
    tried["decoder"] += 1
    check_decoded(frames, limits)


@FUZZ
@given(frames=structured_messages(), limits=st.sampled_from(LIMITS))
def test_decoder_on_mutated_headers(frames: list[bytes], limits: Limits) -> None:
    tried["decoder"] += 1
    check_decoded(frames, limits)


def test_decoder_accepts_a_valid_put() -> None:
    """The oracle is not vacuous: a well-formed put decodes."""
    key = bytes(range(32))
    header = msgpack.packb({"v": 1, "op": "put", "id": 5, "ns": NAMESPACE, "keys": [key]}, use_bin_type=True)
    req = decode_request([header, b"x" * 10], Limits())
    assert req.op is Op.PUT and req.keys == (key,) and req.id == 5


# -- (b) the daemon over a real socket ------------------------------------------------------
@pytest.fixture(scope="module")
def fuzz_daemon(module_daemon_factory: Callable[..., Daemon]) -> Daemon:
    return module_daemon_factory(
        max_local_cpu_size="16MiB", max_keys_per_request=16, stats_log_interval_s=0, shm_lease_timeout_s=0.5
    )


@pytest.fixture(scope="module")
def dealer(fuzz_daemon: Daemon) -> Iterator[zmq.Socket[Any]]:
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(fuzz_daemon.address)
    with CacheClient(fuzz_daemon.address, NAMESPACE, timeout_s=5.0, fail_open=False) as c:
        SEGMENT["token"] = c.hello()["shm"]["segment"]
    try:
        yield sock
    finally:
        sock.close()


def reply_header(frames: list[bytes]) -> bytes:
    # A message starting with an empty frame (and more after it) is REQ-framed: the
    # reply then starts with the echoed empty delimiter.
    return frames[1] if frames[0] == b"" and len(frames) > 1 else frames[0]


PING_ID = 2**64 - 7


def exchange(sock: zmq.Socket[Any], frames: list[bytes]) -> list[Any]:
    """Send one fuzz message, then a ping; return every reply that came before the ping's."""
    sock.send_multipart(frames if frames else [b""])
    ping = msgpack.packb({"v": 1, "op": "ping", "id": PING_ID}, use_bin_type=True)
    sock.send_multipart([ping])
    got: list[Any] = []
    deadline = time.monotonic() + 10
    while True:
        assert sock.poll(max(0, int((deadline - time.monotonic()) * 1000))), f"no reply to {frames!r:.300}"
        parts = sock.recv_multipart()
        reply = decode_reply(reply_header(parts))
        if reply.id == PING_ID and reply.ok:
            return got
        got.append(reply)


@settings(FUZZ, max_examples=SOCKET_EXAMPLES)
@given(frames=messages)
def test_daemon_answers_every_message_once(dealer: zmq.Socket[Any], frames: list[bytes]) -> None:
    tried["socket"] += 1
    replies = exchange(dealer, frames)
    assert len(replies) == 1, f"{len(replies)} replies to {frames!r:.300}: {replies!r:.300}"
    assert replies[0].code != ErrorCode.INTERNAL, f"INTERNAL for {frames!r:.300}: {replies[0].message}"


def test_daemon_still_works_after_fuzzing(fuzz_daemon: Daemon, dealer: zmq.Socket[Any]) -> None:
    assert not dealer.poll(300), "a stray extra reply arrived after the campaign"
    assert fuzz_daemon.proc is not None and fuzz_daemon.proc.poll() is None
    key, data = os.urandom(32), os.urandom(200_000)
    with CacheClient(fuzz_daemon.address, NAMESPACE, timeout_s=5.0, fail_open=False) as c:
        # Slots fuzzed allocs reserved and never committed expire within a second or two.
        wait_for(lambda: c.put([key], [data]) == [0], timeout_s=10)
        got = c.get([key])[0]
        assert got is not None and bytes(got) == data
    print(f"fuzz inputs tried: decoder {tried['decoder']}, socket {tried['socket']}")
