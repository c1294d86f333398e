"""Wire protocol v1: the one definition of request and reply frames.

A message is a ZeroMQ multipart message ``[header, payload_0, ..., payload_n]``:

- ``header``: a msgpack map (string keys).  Requests carry ``v`` (protocol
  version), ``op``, ``id`` (client-chosen unsigned 64-bit request id, echoed
  in the reply), ``ns`` (namespace, for data ops) and per-op fields.
- ``payload_i``: raw chunk bytes, one frame per chunk, never inside msgpack.
- a put, alloc or bind whose header says ``tokens: true`` has one more frame,
  last: every key's token ids as one binary blob (server/tokens.py), so the
  header stays small (its limit does not grow with token ids).

Primitives:

- :func:`encode_request` / :func:`encode_reply` / :func:`encode_error`: build frames.
- :func:`decode_request`: parse and validate a request (server side); raises
  :class:`ProtocolError` carrying the error code and, when known, the request id.
- :func:`decode_reply`: parse a reply header (client side).

See docs/protocol.md for the field-by-field specification.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import msgpack

from .codes import KEY_BYTES, MAX_HEADER_BYTES, MAX_NAMESPACE_BYTES, PROTOCOL_VERSION, ErrorCode, Op

_U64_MAX = 2**64 - 1

# Ops that address chunks by key in a namespace, and whether they carry payloads.
_KEYED_OPS = {Op.PUT, Op.GET, Op.LOOKUP, Op.EXISTS, Op.DELETE, Op.PIN, Op.UNPIN, Op.PREFETCH, Op.ALLOC, Op.BIND}
_NAMESPACED_OPS = _KEYED_OPS | {Op.CLEAR}
_OPS = {op.value: op for op in Op}  # a dict lookup: Op(value) costs ~1.5 us a request
_HEADER_FIELDS = frozenset(("v", "op", "id", "ns", "keys"))
_TOKEN_OPS = frozenset((Op.PUT, Op.ALLOC, Op.BIND))
"""Ops that may carry a tokens frame (``tokens: true``, docs/protocol.md)."""
_CONTAINER_FIELDS = frozenset(("sizes", "slots", "stage", "leases", "owner", "tokens"))
"""The only fields (besides ``keys``) whose value may be a container: anything
else nested in a header is refused (MALFORMED), whatever its size."""


class ProtocolError(Exception):
    """A request the server must refuse; becomes exactly one error reply."""

    def __init__(self, code: ErrorCode, message: str, request_id: int | None = None, limit: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.limit = limit
        """Which input limit was exceeded, if any (the server counts them by it)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Input limits the server enforces while decoding (all inclusive)."""

    max_header_bytes: int = MAX_HEADER_BYTES
    max_keys: int = 4096
    max_message_bytes: int = 1 << 30


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """A decoded, validated request.  ``payloads`` are the raw frames after the header."""

    op: Op
    id: int
    namespace: str | None
    keys: tuple[bytes, ...]
    fields: dict[str, Any]
    payloads: tuple[Any, ...]

    @property
    def payload_bytes(self) -> int:
        return sum(_nbytes(p) for p in self.payloads)


def _nbytes(buf: Any) -> int:
    return memoryview(buf).nbytes


def _buffer(frame: Any) -> Any:
    """The bytes-like content of a frame (pyzmq Frame, bytes or memoryview)."""
    return getattr(frame, "buffer", frame)


def encode_request(
    op: Op,
    request_id: int,
    namespace: str | None = None,
    keys: Sequence[bytes] | None = None,
    payloads: Sequence[Any] = (),
    **fields: Any,
) -> list[Any]:
    """Frames of one request.  ``payloads`` are passed through uncopied."""
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": op.value, "id": request_id}
    if namespace is not None:
        header["ns"] = namespace
    if keys is not None:
        header["keys"] = list(keys)
    header.update(fields)
    return [msgpack.packb(header, use_bin_type=True), *payloads]


def encode_reply(request_id: int | None, payloads: Sequence[Any] = (), **fields: Any) -> list[Any]:
    """Frames of a success reply: header ``{v, id, ok: true, ...fields}`` + payloads."""
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": request_id, "ok": True}
    header.update(fields)
    return [msgpack.packb(header, use_bin_type=True), *payloads]


def encode_error(request_id: int | None, code: ErrorCode, message: str) -> list[Any]:
    """Frames of an error reply: ``{v, id, ok: false, code, name, message}``."""
    header = {
        "v": PROTOCOL_VERSION,
        "id": request_id,
        "ok": False,
        "code": int(code),
        "name": code.name,
        "message": message,
    }
    return [msgpack.packb(header, use_bin_type=True)]


def _peek_id(data: Any, max_bytes: int) -> int | None:
    """The ``id`` of a header too large to decode whole, so the error reply can
    still be matched: looked for in the first ``max_bytes`` only (our clients
    send it third), without materialising the other values."""
    prefix = memoryview(data).cast("B")[:max_bytes]
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(prefix.nbytes, 1))
    try:
        unpacker.feed(prefix)
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() == "id":
                value = unpacker.unpack()
                return value if type(value) is int and 0 <= value <= _U64_MAX else None
            unpacker.skip()
    except Exception:
        return None
    return None


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"ext type {code} is not allowed in a header")


def _unpack_header(data: Any, limits: Limits) -> Any:
    size = _nbytes(data)
    if size > limits.max_header_bytes:
        message = f"header is {size} bytes, limit {limits.max_header_bytes}"
        raise ProtocolError(ErrorCode.TOO_LARGE, message, _peek_id(data, limits.max_header_bytes), limit="header_bytes")
    try:
        # Explicit limits: a hostile header cannot make the unpacker allocate
        # more than the header's own size allows.
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=size,
            max_bin_len=size,
            # Bounded by the header's size (and the header by a limit that leaves
            # no room for token ids: they travel in a frame of their own); the
            # key count is checked after decoding so that the reply can say
            # TOO_MANY_KEYS and echo the id.
            max_array_len=size,
            max_map_len=64,
            max_ext_len=0,
            # max_ext_len=0 still lets an ext of length 0 through (c7 00 05);
            # docs/protocol.md 4.1 refuses every ext value.
            ext_hook=_refuse_ext,
        )
    except (ValueError, msgpack.UnpackException, TypeError) as err:
        raise ProtocolError(ErrorCode.MALFORMED, f"header is not valid msgpack: {err}", limit="msgpack") from None


def decode_request(frames: Sequence[Any], limits: Limits) -> Request:
    """Parse and validate one request (the frames after the ZeroMQ envelope).

    Raises ProtocolError; its ``request_id`` is set as soon as the id is known,
    so the error reply can be matched by the client.
    """
    if not frames:
        raise ProtocolError(ErrorCode.MALFORMED, "empty message: no header frame")
    header = _unpack_header(_buffer(frames[0]), limits)
    if not isinstance(header, dict):
        raise ProtocolError(ErrorCode.MALFORMED, "header must be a msgpack map")

    raw_id = header.get("id")
    # type() is int, not isinstance: msgpack booleans are Python bools, which are ints.
    request_id = raw_id if type(raw_id) is int and 0 <= raw_id <= _U64_MAX else None

    def fail(code: ErrorCode, message: str, limit: str | None = None) -> ProtocolError:
        return ProtocolError(code, message, request_id, limit)

    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise fail(
            ErrorCode.UNSUPPORTED_VERSION,
            f"protocol version {version!r} not supported; this server speaks {PROTOCOL_VERSION}",
        )
    if request_id is None:
        raise fail(ErrorCode.BAD_REQUEST, "'id' must be an unsigned 64-bit integer")
    raw_op = header.get("op")
    op = _OPS.get(raw_op) if isinstance(raw_op, str) else None
    if op is None:
        raise fail(ErrorCode.UNKNOWN_OP, f"unknown op {raw_op!r}")

    buffers = [_buffer(f) for f in frames]
    total = sum(map(_nbytes, buffers)) if len(buffers) > 1 else _nbytes(buffers[0])
    if total > limits.max_message_bytes:
        raise fail(
            ErrorCode.TOO_LARGE,
            f"message is {total} bytes, limit {limits.max_message_bytes}",
            "message_bytes",
        )

    namespace = None
    if op in _NAMESPACED_OPS:
        namespace = _check_namespace(header.get("ns"), fail, allow_missing=op is Op.CLEAR)
    elif "ns" in header and header["ns"] is not None:
        namespace = _check_namespace(header["ns"], fail, allow_missing=True)

    keys: tuple[bytes, ...] = ()
    if op in _KEYED_OPS:
        keys = _check_keys(header.get("keys"), limits, fail)

    token_frame = op in _TOKEN_OPS and header.get("tokens") is True
    payloads = tuple(buffers[1:-1] if token_frame else buffers[1:])
    expected = len(keys) if op is Op.PUT else 0
    if len(buffers) - 1 != expected + token_frame:
        extra = " and a tokens frame" if token_frame else ""
        raise fail(
            ErrorCode.PAYLOAD_MISMATCH,
            f"{op.value} with {len(keys)} keys needs {expected} payload frames{extra}, got {len(buffers) - 1} frames",
        )
    if op is Op.PUT:
        for i, payload in enumerate(payloads):
            if _nbytes(payload) == 0:
                raise fail(ErrorCode.BAD_REQUEST, f"payload {i} is empty")
    fields = {k: v for k, v in header.items() if k not in _HEADER_FIELDS}
    for name, value in fields.items():
        if isinstance(value, (list, dict)) and name not in _CONTAINER_FIELDS:
            raise fail(ErrorCode.MALFORMED, f"field {name!r} must not be an array or a map", "nested")
    if token_frame:
        fields["tokens"] = buffers[-1]
    return Request(op, request_id, namespace, keys, fields, payloads)


def _check_namespace(value: Any, fail: Any, *, allow_missing: bool) -> str | None:
    if value is None and allow_missing:
        return None
    if not isinstance(value, str) or not value:
        raise fail(ErrorCode.BAD_NAMESPACE, "'ns' must be a non-empty string")
    if len(value.encode()) > MAX_NAMESPACE_BYTES:
        raise fail(ErrorCode.BAD_NAMESPACE, f"'ns' is longer than {MAX_NAMESPACE_BYTES} bytes")
    return value


_KEY_LENGTHS = frozenset((KEY_BYTES,))


def _check_keys(value: Any, limits: Limits, fail: Any) -> tuple[bytes, ...]:
    if not isinstance(value, list):
        raise fail(ErrorCode.BAD_REQUEST, "'keys' must be an array of binary keys")
    if len(value) > limits.max_keys:
        raise fail(ErrorCode.TOO_MANY_KEYS, f"{len(value)} keys, limit {limits.max_keys}", "keys")
    try:
        # The common case, checked at C speed (the loop below names the bad key):
        # join takes only bytes-like values, and the one msgpack decodes is bytes.
        b"".join(value)
    except TypeError:
        pass
    else:
        if set(map(len, value)) <= _KEY_LENGTHS:
            return tuple(value)
    for i, key in enumerate(value):
        if not isinstance(key, bytes):
            raise fail(ErrorCode.BAD_KEY, f"key {i} is {type(key).__name__}, expected bin")
        if len(key) != KEY_BYTES:
            raise fail(ErrorCode.BAD_KEY, f"key {i} is {len(key)} bytes, expected {KEY_BYTES}")
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class Reply:
    """A decoded reply header (client side); payload frames travel beside it."""

    id: int | None
    ok: bool
    fields: dict[str, Any]
    code: ErrorCode | int | None = None
    message: str = ""


def decode_reply(data: Any) -> Reply:
    """Parse a reply header frame.  Raises ValueError if it is not a v1 reply."""
    header = msgpack.unpackb(data, raw=False, strict_map_key=True)
    if not isinstance(header, dict) or header.get("v") != PROTOCOL_VERSION:
        raise ValueError(f"not a protocol v{PROTOCOL_VERSION} reply: {header!r:.200}")
    ok = bool(header.get("ok"))
    if ok:
        return Reply(header.get("id"), True, header)
    raw_code = header.get("code", ErrorCode.INTERNAL)
    try:
        code: ErrorCode | int = ErrorCode(raw_code)
    except ValueError:
        code = raw_code
    return Reply(header.get("id"), False, header, code, str(header.get("message", "")))
