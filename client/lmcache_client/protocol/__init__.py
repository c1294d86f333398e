"""Wire protocol v1 (one definition, imported by the server too).

- codes: PROTOCOL_VERSION, KEY_BYTES, Op, ErrorCode, PutStatus, the header limit
  (MAX_KEYS_PER_REQUEST, MAX_HEADER_BYTES, header_limit)
- messages: encode/decode of request and reply frames, ProtocolError, Limits
"""

from .codes import (
    KEY_BYTES,
    MAX_HEADER_BYTES,
    MAX_KEYS_PER_REQUEST,
    MAX_NAMESPACE_BYTES,
    PROTOCOL_VERSION,
    ErrorCode,
    Op,
    PutStatus,
    header_limit,
)
from .messages import (
    Limits,
    ProtocolError,
    Reply,
    Request,
    decode_reply,
    decode_request,
    encode_error,
    encode_reply,
    encode_request,
)

__all__ = [
    "KEY_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_KEYS_PER_REQUEST",
    "MAX_NAMESPACE_BYTES",
    "PROTOCOL_VERSION",
    "ErrorCode",
    "Limits",
    "Op",
    "ProtocolError",
    "PutStatus",
    "Reply",
    "Request",
    "decode_reply",
    "decode_request",
    "encode_error",
    "encode_reply",
    "encode_request",
    "header_limit",
]
