"""Bad input on the wire: every malformed request gets exactly one error reply.

These tests talk to the real daemon through raw pyzmq sockets (DEALER, and a
REQ socket for the envelope-with-delimiter case) and hand-built msgpack, never
through the client library, which cannot produce such requests.

For every kind of bad input a test checks that

- exactly one reply comes back (no silence, no second reply),
- it is a well-formed v1 error reply: one frame, header ``{v: 1, ok: false,
  code: int, name: ErrorCode name, message: non-empty str, id}`` where ``id``
  echoes the request's id when the server could read it and is null otherwise,
- its code is the stable ErrorCode for that kind of input,
- the daemon keeps serving: afterwards a put + get of fresh data round-trips
  with the right bytes, on the same raw connection (which would also expose a
  stray extra reply) and through a fresh client connection.

Every receive is bounded by a poll timeout, so a missing reply fails the test
instead of hanging it.
"""

from __future__ import annotations

import itertools
import os
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq

from lmcache_client.protocol import ErrorCode, PutStatus
from lmcache_client.protocol.codes import KEY_BYTES, MAX_NAMESPACE_BYTES, PROTOCOL_VERSION

NS = "test-model|float16|L2|KV2|D64|tp0of1|c16"
RID = 4242
"""The request id of a bad request whose id the server can read."""
REPLY_TIMEOUT_S = 5.0
QUIET_S = 0.1
"""How long to listen for a (wrong) second reply after the expected one."""
MiB = 1024 * 1024

_ids = itertools.count(1_000_000)


# -- building requests by hand ------------------------------------------------------
def pack(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def hdr(op: Any = "ping", request_id: Any = RID, **fields: Any) -> dict[str, Any]:
    """A v1 request header as a dict, to be broken on purpose by the caller."""
    return {"v": PROTOCOL_VERSION, "op": op, "id": request_id, **fields}


def key(i: int = 0) -> bytes:
    return bytes([i % 256] * int(KEY_BYTES))


def keys(n: int) -> list[bytes]:
    return [key(i) for i in range(n)]


def new_id() -> int:
    return next(_ids)


# -- a raw peer -----------------------------------------------------------------------
class RawPeer:
    """One raw ZeroMQ socket speaking protocol v1 by hand; every receive is bounded."""

    def __init__(self, ctx: zmq.Context[Any], address: str, socket_type: int = zmq.DEALER):
        self.sock = ctx.socket(socket_type)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout_s: float = REPLY_TIMEOUT_S) -> list[bytes]:
        if not self.sock.poll(timeout_s * 1000, zmq.POLLIN):
            raise AssertionError(f"no reply within {timeout_s}s")
        frames: list[bytes] = self.sock.recv_multipart()
        return frames

    def assert_quiet(self, quiet_s: float = QUIET_S) -> None:
        if self.sock.poll(quiet_s * 1000, zmq.POLLIN):
            extra = self.sock.recv_multipart()
            raise AssertionError(f"unexpected extra message: {extra!r:.300}")

    def request(self, frames: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        """Send one request, receive one reply: (header, payload frames)."""
        self.send(frames)
        reply = self.recv()
        return decode_header(reply[0]), reply[1:]

    def close(self) -> None:
        self.sock.close(linger=0)


def decode_header(frame: bytes) -> dict[str, Any]:
    header = msgpack.unpackb(frame, raw=False)
    assert isinstance(header, dict), f"reply header is not a map: {header!r:.300}"
    return header


def check_error(reply: list[bytes], code: ErrorCode, request_id: int | None) -> dict[str, Any]:
    """Assert ``reply`` is exactly one well-formed v1 error reply with this code and id."""
    assert len(reply) == 1, f"an error reply is one frame, got {len(reply)}: {reply!r:.300}"
    header = decode_header(reply[0])
    shown = f"expected {code.name} with id {request_id!r}, got {header!r}"
    assert header.get("v") == PROTOCOL_VERSION and type(header["v"]) is int, shown
    assert header.get("ok") is False, shown
    assert type(header.get("code")) is int, shown
    assert (header["code"], header.get("name")) == (int(code), code.name), shown
    assert isinstance(header.get("message"), str) and header["message"].strip(), shown
    assert "id" in header, shown
    if request_id is None:
        assert header["id"] is None, shown
    else:
        assert type(header["id"]) is int and header["id"] == request_id, shown
    return header


def expect_error(peer: RawPeer, frames: list[bytes], code: ErrorCode, request_id: int | None = RID) -> dict[str, Any]:
    peer.send(frames)
    return check_error(peer.recv(), code, request_id)


# -- proof that the daemon still serves -------------------------------------------------
def raw_roundtrip(peer: RawPeer, namespace: str = NS, size: int = 4096) -> None:
    """A put + get of fresh random bytes over ``peer``; any stray reply fails it."""
    k, data = os.urandom(KEY_BYTES), os.urandom(size)
    rid = new_id()
    header, payloads = peer.request([pack(hdr("put", rid, ns=namespace, keys=[k])), data])
    assert header.get("id") == rid, f"not the put's reply (a stray one?): {header}"
    assert header.get("ok") is True and header.get("status") == [int(PutStatus.STORED)], header
    assert payloads == []
    rid = new_id()
    header, payloads = peer.request([pack(hdr("get", rid, ns=namespace, keys=[k]))])
    assert header.get("id") == rid, f"not the get's reply (a stray one?): {header}"
    assert header.get("ok") is True and header.get("found") == [True], header
    assert payloads == [data], "get returned other bytes than were put"


def assert_serving(daemon: Any, *peers: RawPeer) -> None:
    """The daemon is alive and serves put + get on ``peers`` and on a fresh client."""
    assert daemon.proc.poll() is None, f"daemon exited:\n{daemon.log()}"
    for peer in peers:
        raw_roundtrip(peer)
        peer.assert_quiet()
    k, data = os.urandom(KEY_BYTES), os.urandom(10_000)
    with daemon.client() as client:
        assert client.put([k], [data]) == [PutStatus.STORED]
        got = client.get([k])
        assert got[0] is not None and bytes(got[0]) == data


# -- fixtures -----------------------------------------------------------------------------
# One daemon per configuration for the whole module: every test proves the
# daemon still serves after its bad input, so sharing it is the stronger test.
@pytest.fixture(scope="module")
def daemon(module_daemon_factory: Callable[..., Any]) -> Any:
    return module_daemon_factory()


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def open_peer(ctx: zmq.Context[Any]) -> Iterator[Callable[..., RawPeer]]:
    peers: list[RawPeer] = []

    def open_(daemon: Any, socket_type: int = zmq.DEALER) -> RawPeer:
        peer = RawPeer(ctx, daemon.address, socket_type)
        peers.append(peer)
        return peer

    yield open_
    for peer in peers:
        peer.close()


@pytest.fixture
def peer(daemon: Any, open_peer: Callable[..., RawPeer]) -> RawPeer:
    """A raw DEALER connected to the default daemon."""
    return open_peer(daemon)


# -- the header frame itself is bad: MALFORMED, id unknown ------------------------------
_PING = pack(hdr("ping", RID))


def _nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\x00"  # [[[...[0]...]]]


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(b"\xc1", id="reserved-byte-0xc1"),
        pytest.param(b"hello, server", id="plain-text"),
        pytest.param(b"\xff\xfe\x00\x01garbage\x00", id="binary-garbage"),
        pytest.param(_PING + b"\x00", id="trailing-bytes-after-map"),
        pytest.param(pack([1, "ping", RID]), id="not-a-map-list"),
        pytest.param(pack(RID), id="not-a-map-int"),
        pytest.param(pack("ping"), id="not-a-map-str"),
        pytest.param(pack(None), id="not-a-map-nil"),
        pytest.param(pack(b"\x01\x02"), id="not-a-map-bin"),
        pytest.param(pack(1.5), id="not-a-map-float"),
        pytest.param(pack({1: 1, 2: "ping"}), id="map-with-int-keys"),
        pytest.param(pack(msgpack.ExtType(7, b"ext")), id="ext-type"),
        # docs/protocol.md 4.1: no ext value anywhere, whatever its length (c7 00 05: ext8, length 0, type 5).
        pytest.param(b"\xc7\x00\x05", id="zero-length-ext-alone"),
        pytest.param(pack(hdr("ping", x=msgpack.ExtType(5, b""))), id="zero-length-ext-in-the-map"),
        pytest.param(pack(hdr("ping", x=[1, {"y": msgpack.ExtType(5, b"")}])), id="zero-length-ext-nested"),
        pytest.param(b"\x84" + pack(hdr("ping"))[1:] + pack("x") + b"\xc7\x00\xff", id="zero-length-timestamp-ext"),
        pytest.param(_nested(5000), id="nested-5000-deep"),
        pytest.param(_PING[:1], id="truncated-to-1-byte"),
        pytest.param(_PING[: len(_PING) // 2], id="truncated-to-half"),
        pytest.param(_PING[:-1], id="truncated-by-1-byte"),
    ],
)
def test_malformed_header_frame(daemon: Any, peer: RawPeer, frame: bytes) -> None:
    expect_error(peer, [frame], ErrorCode.MALFORMED, request_id=None)
    assert_serving(daemon, peer)


def test_truncated_header_with_payload_frames(daemon: Any, peer: RawPeer) -> None:
    put = pack(hdr("put", ns=NS, keys=keys(2)))
    expect_error(peer, [put[:-5], b"a" * 100, b"b" * 100], ErrorCode.MALFORMED, request_id=None)
    assert_serving(daemon, peer)


def test_empty_header_frame(daemon: Any, peer: RawPeer) -> None:
    """A DEALER's lone empty frame is an empty header (a REQ delimiter is never alone)."""
    expect_error(peer, [b""], ErrorCode.MALFORMED, request_id=None)
    assert_serving(daemon, peer)


# -- header fields --------------------------------------------------------------------------
@pytest.mark.parametrize("version", [2, 0, -1, "1", None, "missing"], ids=lambda v: f"v={v!r}")
def test_unsupported_version_echoes_id(daemon: Any, peer: RawPeer, version: Any) -> None:
    header = hdr("ping")
    if version == "missing":
        del header["v"]
    else:
        header["v"] = version
    expect_error(peer, [pack(header)], ErrorCode.UNSUPPORTED_VERSION, request_id=RID)
    assert_serving(daemon, peer)


def test_unsupported_version_without_id(daemon: Any, peer: RawPeer) -> None:
    expect_error(peer, [pack({"v": 2, "op": "ping"})], ErrorCode.UNSUPPORTED_VERSION, request_id=None)
    assert_serving(daemon, peer)


@pytest.mark.parametrize(
    ("op", "request_id"),
    [
        ("fly", RID),
        ("PING", RID),
        ("", RID),
        (7, RID),
        (None, RID),
        (["ping"], RID),
        ("missing", RID),
        ("fly", 0),
        ("fly", 2**64 - 1),
    ],
    ids=lambda v: repr(v),
)
def test_unknown_op_echoes_id(daemon: Any, peer: RawPeer, op: Any, request_id: int) -> None:
    header = hdr(op, request_id)
    if op == "missing":
        del header["op"]
    expect_error(peer, [pack(header)], ErrorCode.UNKNOWN_OP, request_id=request_id)
    assert_serving(daemon, peer)


@pytest.mark.parametrize(
    "request_id",
    ["missing", None, -1, -(2**63), "7", 1.5, 7.0, True, False, [7], b"\x07", {"id": 7}],
    ids=lambda v: f"id={v!r}",
)
def test_bad_request_id(daemon: Any, peer: RawPeer, request_id: Any) -> None:
    header = hdr("ping", request_id)
    if request_id == "missing":
        del header["id"]
    expect_error(peer, [pack(header)], ErrorCode.BAD_REQUEST, request_id=None)
    assert_serving(daemon, peer)


# -- keys -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad_keys",
    [
        pytest.param([b"k" * 31], id="31-bytes"),
        pytest.param([b"k" * 33], id="33-bytes"),
        pytest.param([b""], id="0-bytes"),
        pytest.param(["k" * 32], id="str-not-bin"),
        pytest.param([7], id="int"),
        pytest.param([None], id="nil"),
        pytest.param([key(0), b"k" * 31], id="second-key-31-bytes"),
        pytest.param([key(0), "k" * 32], id="second-key-str"),
    ],
)
@pytest.mark.parametrize("op", ["put", "get"])
def test_bad_key(daemon: Any, peer: RawPeer, op: str, bad_keys: list[Any]) -> None:
    payloads = [b"x" * 64 for _ in bad_keys] if op == "put" else []
    expect_error(peer, [pack(hdr(op, ns=NS, keys=bad_keys)), *payloads], ErrorCode.BAD_KEY)
    assert_serving(daemon, peer)


@pytest.mark.parametrize(
    "bad_keys",
    [
        pytest.param("missing", id="missing"),
        pytest.param(None, id="nil"),
        pytest.param(key(0), id="one-bin-key-not-in-a-list"),
        pytest.param("k" * 32, id="str"),
        pytest.param(3, id="int"),
        pytest.param({"0": key(0)}, id="map"),
    ],
)
@pytest.mark.parametrize("op", ["put", "get"])
def test_keys_not_a_list(daemon: Any, peer: RawPeer, op: str, bad_keys: Any) -> None:
    header = hdr(op, ns=NS, keys=bad_keys)
    if bad_keys == "missing":
        del header["keys"]
    payloads = [b"x" * 64] if op == "put" else []
    expect_error(peer, [pack(header), *payloads], ErrorCode.BAD_REQUEST)
    assert_serving(daemon, peer)


# -- payload frames ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("op", "n_keys", "n_payloads"),
    [
        ("put", 2, 1),  # truncated multipart: a payload frame is missing
        ("put", 3, 0),
        ("put", 1, 2),  # one frame too many
        ("put", 0, 1),
        ("get", 1, 1),
        ("get", 2, 3),
        ("lookup", 1, 1),
        ("ping", 0, 1),
    ],
    ids=lambda v: str(v),
)
def test_payload_count_mismatch(daemon: Any, peer: RawPeer, op: str, n_keys: int, n_payloads: int) -> None:
    header = hdr(op) if op == "ping" else hdr(op, ns=NS, keys=keys(n_keys))
    payloads = [bytes([65 + i]) * 128 for i in range(n_payloads)]
    expect_error(peer, [pack(header), *payloads], ErrorCode.PAYLOAD_MISMATCH)
    assert_serving(daemon, peer)


def test_put_payload_mismatch_stores_nothing(daemon: Any, peer: RawPeer) -> None:
    """A refused put is all-or-nothing: none of its keys appear."""
    ks = [os.urandom(KEY_BYTES) for _ in range(3)]
    expect_error(peer, [pack(hdr("put", ns=NS, keys=ks)), b"a" * 64, b"b" * 64], ErrorCode.PAYLOAD_MISMATCH)
    header, _ = peer.request([pack(hdr("exists", new_id(), ns=NS, keys=ks))])
    assert header.get("ok") is True and header.get("exists") == [False, False, False], header
    assert_serving(daemon, peer)


@pytest.mark.parametrize("empty_index", [0, 1])
def test_empty_payload_frame_in_put(daemon: Any, peer: RawPeer, empty_index: int) -> None:
    payloads = [b"p" * 64, b"q" * 64]
    payloads[empty_index] = b""
    expect_error(peer, [pack(hdr("put", ns=NS, keys=keys(2))), *payloads], ErrorCode.BAD_REQUEST)
    assert_serving(daemon, peer)


# -- namespaces ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ns",
    [
        pytest.param("missing", id="missing"),
        pytest.param(None, id="nil"),
        pytest.param("", id="empty"),
        pytest.param("n" * (MAX_NAMESPACE_BYTES + 1), id="513-ascii-bytes"),
        pytest.param("\u20ac" * 171, id="513-utf8-bytes-171-chars"),
        pytest.param("n" * 10_000, id="10000-bytes"),
        pytest.param(NS.encode(), id="bin-not-str"),
        pytest.param(7, id="int"),
        pytest.param([NS], id="list"),
    ],
)
@pytest.mark.parametrize("op", ["put", "get"])
def test_bad_namespace(daemon: Any, peer: RawPeer, op: str, ns: Any) -> None:
    header = hdr(op, ns=ns, keys=[key(1)])
    if ns == "missing":
        del header["ns"]
    payloads = [b"x" * 64] if op == "put" else []
    expect_error(peer, [pack(header), *payloads], ErrorCode.BAD_NAMESPACE)
    assert_serving(daemon, peer)


@pytest.mark.parametrize("ns", ["n" * MAX_NAMESPACE_BYTES, "\u20ac" * 170 + "nn"], ids=["ascii", "utf8"])
def test_namespace_of_exactly_512_bytes_is_accepted(daemon: Any, peer: RawPeer, ns: str) -> None:
    assert len(ns.encode()) == MAX_NAMESPACE_BYTES
    raw_roundtrip(peer, namespace=ns)
    assert_serving(daemon, peer)


# -- clear ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields",
    [{}, {"all": False}, {"all": "true"}, {"all": 1}, {"all": None}, {"ns": None}],
    ids=lambda f: repr(f),
)
def test_clear_without_ns_or_all_true(daemon: Any, peer: RawPeer, fields: dict[str, Any]) -> None:
    k, data = os.urandom(KEY_BYTES), os.urandom(1000)
    header, _ = peer.request([pack(hdr("put", new_id(), ns=NS, keys=[k])), data])
    assert header.get("status") == [int(PutStatus.STORED)], header
    expect_error(peer, [pack(hdr("clear", **fields))], ErrorCode.BAD_REQUEST)
    # The refused clear removed nothing.
    header, payloads = peer.request([pack(hdr("get", new_id(), ns=NS, keys=[k]))])
    assert header.get("found") == [True] and payloads == [data], header
    assert_serving(daemon, peer)


# -- limits: keys per request -----------------------------------------------------------------
@pytest.fixture(scope="module")
def small_keys_daemon(module_daemon_factory: Callable[..., Any]) -> Any:
    return module_daemon_factory(max_keys_per_request=8)


@pytest.mark.parametrize("n_keys", [9, 24, 25, 1000])
@pytest.mark.parametrize("op", ["put", "get", "lookup"])
def test_too_many_keys(small_keys_daemon: Any, open_peer: Callable[..., RawPeer], op: str, n_keys: int) -> None:
    peer = open_peer(small_keys_daemon)
    payloads = [b"x" * 64] * n_keys if op == "put" else []
    header = hdr(op, ns=NS, keys=[os.urandom(KEY_BYTES) for _ in range(n_keys)])
    expect_error(peer, [pack(header), *payloads], ErrorCode.TOO_MANY_KEYS)
    assert_serving(small_keys_daemon, peer)


def test_max_keys_per_request_itself_is_accepted(small_keys_daemon: Any, open_peer: Callable[..., RawPeer]) -> None:
    peer = open_peer(small_keys_daemon)
    ks = [os.urandom(KEY_BYTES) for _ in range(8)]
    datas = [os.urandom(100 + i) for i in range(8)]
    header, _ = peer.request([pack(hdr("put", new_id(), ns=NS, keys=ks)), *datas])
    assert header.get("status") == [int(PutStatus.STORED)] * 8, header
    header, payloads = peer.request([pack(hdr("get", new_id(), ns=NS, keys=ks))])
    assert header.get("found") == [True] * 8 and payloads == datas, header
    assert_serving(small_keys_daemon, peer)


# -- limits: message size --------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_message_daemon(module_daemon_factory: Callable[..., Any]) -> Any:
    return module_daemon_factory(max_message_size="1MiB", max_inflight_bytes="4MiB")


@pytest.mark.parametrize(
    "payload_sizes",
    [
        pytest.param([MiB * 3 // 2], id="one-1.5MiB-frame"),
        pytest.param([MiB * 2], id="one-frame-of-exactly-2x"),
        pytest.param([MiB * 9 // 10] * 3, id="three-0.9MiB-frames"),
        pytest.param([MiB // 2, MiB // 2 + 1], id="two-halves-plus-1-byte"),
    ],
)
def test_oversized_message_gets_too_large(
    small_message_daemon: Any, open_peer: Callable[..., RawPeer], payload_sizes: list[int]
) -> None:
    peer = open_peer(small_message_daemon)
    ks = [os.urandom(KEY_BYTES) for _ in payload_sizes]
    frames = [pack(hdr("put", ns=NS, keys=ks)), *(os.urandom(n) for n in payload_sizes)]
    expect_error(peer, frames, ErrorCode.TOO_LARGE)
    header, _ = peer.request([pack(hdr("exists", new_id(), ns=NS, keys=ks))])
    assert header.get("exists") == [False] * len(ks), header
    assert_serving(small_message_daemon, peer)


def test_message_of_exactly_max_size_is_accepted(small_message_daemon: Any, open_peer: Callable[..., RawPeer]) -> None:
    peer = open_peer(small_message_daemon)
    k, rid = os.urandom(KEY_BYTES), new_id()
    header = pack(hdr("put", rid, ns=NS, keys=[k]))
    data = os.urandom(MiB - len(header))
    reply, _ = peer.request([header, data])
    assert reply.get("id") == rid and reply.get("status") == [int(PutStatus.STORED)], reply
    reply, payloads = peer.request([pack(hdr("get", new_id(), ns=NS, keys=[k]))])
    assert reply.get("found") == [True] and payloads == [data], reply
    # One byte more is refused.
    k2 = os.urandom(KEY_BYTES)
    header = pack(hdr("put", ns=NS, keys=[k2]))
    expect_error(peer, [header, os.urandom(MiB - len(header) + 1)], ErrorCode.TOO_LARGE)
    assert_serving(small_message_daemon, peer)


def test_oversized_header_gets_too_large(small_message_daemon: Any, open_peer: Callable[..., RawPeer]) -> None:
    """A 512 KiB header (under max_message_size, far over what 4096 keys need) is
    refused without being decoded; its id is still read, so the client can match
    the reply, and the id is null when the header gives none."""
    peer = open_peer(small_message_daemon)
    expect_error(peer, [pack(hdr("ping", RID, pad="p" * (MiB // 2)))], ErrorCode.TOO_LARGE, request_id=RID)
    header = {"pad": "p" * (MiB // 2), "v": 1, "op": "ping"}
    expect_error(peer, [pack(header)], ErrorCode.TOO_LARGE, request_id=None)
    # Only the first header-limit bytes are read for the id (docs/protocol.md 6.3):
    # an id behind a pad larger than that is not looked for.
    header = {"pad": "p" * (MiB // 2), "v": 1, "op": "ping", "id": RID}
    expect_error(peer, [pack(header)], ErrorCode.TOO_LARGE, request_id=None)
    # ... one behind fields that fit is found.
    header = {"v": 1, "op": "ping", "keys": [key(i) for i in range(100)], "id": RID, "pad": "p" * (MiB // 2)}
    expect_error(peer, [pack(header)], ErrorCode.TOO_LARGE, request_id=RID)
    assert_serving(small_message_daemon, peer)


def test_frame_over_twice_max_message_size_drops_the_connection(
    small_message_daemon: Any, open_peer: Callable[..., RawPeer]
) -> None:
    """libzmq drops a peer sending a frame over 2 x max_message_size; the daemon lives on."""
    peer = open_peer(small_message_daemon)
    raw_roundtrip(peer)  # connected and served before
    peer.send([pack(hdr("put", ns=NS, keys=[os.urandom(KEY_BYTES)])), os.urandom(MiB * 5 // 2)])
    assert not peer.sock.poll(1000, zmq.POLLIN), "a reply came to a request over the hard frame limit"
    assert small_message_daemon.proc.poll() is None, small_message_daemon.log()
    assert_serving(small_message_daemon, open_peer(small_message_daemon))


# -- REQ sockets (envelope with an empty delimiter frame) -----------------------------------
def test_req_socket_gets_replies(daemon: Any, open_peer: Callable[..., RawPeer]) -> None:
    req = open_peer(daemon, zmq.REQ)
    rid = new_id()
    header, payloads = req.request([pack(hdr("ping", rid))])
    assert header.get("ok") is True and header.get("id") == rid and payloads == [], header
    expect_error(req, [b"\xc1"], ErrorCode.MALFORMED, request_id=None)
    expect_error(req, [pack([1, 2, 3])], ErrorCode.MALFORMED, request_id=None)
    expect_error(req, [b""], ErrorCode.MALFORMED, request_id=None)
    expect_error(req, [pack(hdr("fly"))], ErrorCode.UNKNOWN_OP)
    expect_error(req, [pack(hdr("put", ns=NS, keys=keys(2))), b"x" * 10], ErrorCode.PAYLOAD_MISMATCH)
    assert_serving(daemon, req)


# -- a burst of assorted garbage --------------------------------------------------------------
def readable_id(header_frame: bytes) -> int | None:
    """The id a server can read from this header frame (a uint64 in a map), else None."""
    try:
        header = msgpack.unpackb(header_frame, raw=False, strict_map_key=True)
    except Exception:
        return None
    if not isinstance(header, dict):
        return None
    rid = header.get("id")
    return rid if type(rid) is int and 0 <= rid < 2**64 else None


def _garbage(rng: random.Random, n: int) -> list[list[bytes]]:
    """``n`` bad (or at least odd) messages, from a seeded RNG."""
    ops = ["ping", "put", "get", "lookup", "exists", "delete", "pin", "unpin", "stats", "fly", "", 3]
    messages: list[list[bytes]] = []
    for i in range(n):
        kind = i % 4
        if kind == 0:  # random bytes in a random number of frames
            frames = [rng.randbytes(rng.randint(1, 64))]
            frames += [rng.randbytes(rng.randint(0, 256)) for _ in range(rng.randint(0, 5))]
        elif kind == 1:  # a valid header with a few bytes flipped or cut off
            raw = bytearray(pack(hdr("put", new_id(), ns=NS, keys=keys(2))))
            for _ in range(rng.randint(1, 3)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            cut = rng.randint(1, len(raw))
            frames = [bytes(raw[:cut]), b"a" * 64, b"b" * 64][: rng.randint(1, 3)]
        elif kind == 2:  # valid msgpack that is not a map
            obj: Any = rng.choice([[1, "put"], 42, "ping", None, b"\x00" * 5, 2.5, True, [], [[{}]]])
            frames = [pack(obj)] + [b"p" * 10] * rng.randint(0, 2)
        else:  # a map with random, mostly wrong fields and a readable id
            rid = new_id()
            header: dict[str, Any] = {"id": rid}
            if rng.random() < 0.8:
                header["v"] = rng.choice([1, 1, 1, 2, 0, "1"])
            if rng.random() < 0.9:
                header["op"] = rng.choice(ops)
            if rng.random() < 0.8:
                header["ns"] = rng.choice([NS, "", "x" * 600, b"bin", 5, "fuzz"])
            if rng.random() < 0.8:
                header["keys"] = rng.choice(
                    [keys(rng.randint(0, 4)), [b"short"], ["s" * 32], b"k" * 32, 7, [key(1)] * 2]
                )
            frames = [pack(header)] + [rng.randbytes(rng.randint(0, 40)) for _ in range(rng.randint(0, 4))]
        messages.append(frames)
    return messages


def test_burst_of_garbage_gets_one_reply_each(daemon: Any, peer: RawPeer) -> None:
    rng = random.Random(0x1CAC4E)
    messages = _garbage(rng, 200)
    readable_ids = [rid for rid in (readable_id(m[0]) for m in messages) if rid is not None]
    assert len(messages) == 200 and len(readable_ids) >= 50
    for frames in messages:
        peer.send(frames)

    replies: list[dict[str, Any]] = []
    deadline = time.monotonic() + 30
    while len(replies) < len(messages):
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"only {len(replies)} replies to {len(messages)} messages"
        reply = peer.recv(timeout_s=min(remaining, REPLY_TIMEOUT_S))
        header = decode_header(reply[0])
        assert header.get("v") == PROTOCOL_VERSION and isinstance(header.get("ok"), bool), header
        if not header["ok"]:
            check_error(reply, ErrorCode(header["code"]), header.get("id"))
            assert header["code"] != ErrorCode.INTERNAL, header
        replies.append(header)
    peer.assert_quiet(0.3)

    # One reply per message: each readable id as often as it was sent, every other reply id-less.
    got_ids = sorted(h["id"] for h in replies if h.get("id") is not None)
    assert got_ids == sorted(readable_ids)
    assert sum(h.get("id") is None for h in replies) == len(messages) - len(readable_ids)
    assert_serving(daemon, peer)
