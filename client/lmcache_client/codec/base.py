"""The codec interface and the ``none`` codec.

A :class:`Codec` turns one chunk tensor of the L2THD layout
``(layers, 2, tokens, kv heads, head dim)`` into one self-describing,
checksummed frame (:mod:`.frame`) and back.  Subclasses implement two
methods on tensors; the frame, the checks and the all-or-nothing write into
``out`` are written once, here.

Primitives: :class:`Codec` (``encode``, ``decode``, ``decode_tensor``,
``max_encoded_bytes``, ``raw_bytes``) and :class:`NoneCodec`.
"""

from __future__ import annotations

from typing import Any

import torch

from . import frame
from .frame import CodecError
from .spec import CodecSpec

Shape5 = tuple[int, int, int, int, int]

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def dtype_name(dtype: Any) -> str:
    """``"bfloat16"`` etc. for a torch dtype; ValueError for dtypes the codec does not handle."""
    name = _DTYPES.get(dtype)
    if name is None:
        raise ValueError(f"KV codec handles bfloat16, float16 and float32 chunks, not {dtype}")
    return name


class Codec:
    """Encode/decode chunks of one layout with one :class:`CodecSpec`.

    ``encode`` returns ``bytes`` on the CPU whatever device the chunk is on;
    ``decode`` writes into ``out`` (CPU or CUDA) only once the whole frame has
    been checked and decoded, and raises :class:`CodecError` otherwise, so a
    caller can treat any error as a miss.  Any ``1 <= tokens <= shape[2]``
    is accepted (a prompt's partial last chunk); the frame records it.
    """

    def __init__(self, spec: CodecSpec, shape: Shape5, dtype: Any) -> None:
        if len(shape) != 5 or shape[1] != 2 or any(int(s) <= 0 for s in shape):
            raise ValueError(f"chunk shape must be (layers, 2, tokens, kv_heads, head_dim); got {shape}")
        self.spec = spec
        self.shape: Shape5 = tuple(int(s) for s in shape)  # type: ignore[assignment]
        self.dtype = dtype
        self.dtype_name = dtype_name(dtype)
        self.element_bytes = torch.empty((), dtype=dtype).element_size()
        self.tag = spec.tag

    # -- sizes ---------------------------------------------------------------
    def raw_bytes(self, tokens: int) -> int:
        """Bytes of the uncompressed chunk of ``tokens`` tokens."""
        layers, kv, _, heads, dim = self.shape
        return layers * kv * tokens * heads * dim * self.element_bytes

    def max_encoded_bytes(self, tokens: int) -> int:
        """An upper bound on ``len(encode(chunk))`` for a chunk of ``tokens`` tokens."""
        return frame.header_bytes(self.tag) + self._max_body_bytes(tokens)

    # -- the two directions ----------------------------------------------------
    def encode(self, chunk: torch.Tensor) -> bytes:
        """One frame (bytes, on the CPU) for ``chunk`` of shape (L, 2, T, H, D), T <= chunk tokens."""
        tokens = self._check_shape(tuple(chunk.shape), "chunk")
        if chunk.dtype != self.dtype:
            raise ValueError(f"chunk dtype {chunk.dtype} differs from the codec's {self.dtype}")
        body = self._encode_body(chunk.contiguous())
        shape = (*self.shape[:2], tokens, *self.shape[3:])
        return frame.pack(self.spec.mode_id, frame.DTYPE_CODES[self.dtype_name], self.tag, shape, body)

    def decode(self, buf: bytes | bytearray | memoryview, out: torch.Tensor) -> None:
        """Decode ``buf`` into ``out`` (its shape must be the encoded one); CodecError when it is not a valid frame."""
        if out.dtype != self.dtype:
            raise ValueError(f"out dtype {out.dtype} differs from the codec's {self.dtype}")
        tensor = self._decode_checked(buf, out.device)
        if tuple(out.shape) != tuple(tensor.shape):
            raise CodecError(f"encoded chunk has shape {tuple(tensor.shape)}; out has {tuple(out.shape)}")
        out.copy_(tensor)  # the lossy modes decode in float32: the cast to the chunk dtype happens here

    def decode_tensor(self, buf: bytes | bytearray | memoryview, device: Any = "cpu") -> torch.Tensor:
        """Decode ``buf`` into a new tensor on ``device``; CodecError when it is not a valid frame."""
        return self._decode_checked(buf, torch.device(device)).to(self.dtype)

    def _decode_checked(self, buf: bytes | bytearray | memoryview, device: torch.device) -> torch.Tensor:
        header, body = frame.unpack(buf)
        if header.mode_id != self.spec.mode_id or header.tag != self.tag:
            raise CodecError(f"encoded chunk is of codec {header.tag!r}, not {self.tag!r}")
        if header.dtype_code != frame.DTYPE_CODES[self.dtype_name]:
            raise CodecError(f"encoded chunk has dtype code {header.dtype_code}, not {self.dtype_name}")
        try:
            self._check_shape(header.shape, "encoded chunk")
        except ValueError as err:
            raise CodecError(str(err)) from err
        try:
            tensor = self._decode_body(body, header.shape[2], device)
        except CodecError:
            raise
        except Exception as err:  # a body that passed its checksum but does not decode
            raise CodecError(f"encoded chunk body does not decode: {err}") from err
        if tuple(tensor.shape) != header.shape:
            raise CodecError("encoded chunk body decodes to the wrong shape")
        return tensor

    # -- for subclasses ----------------------------------------------------------
    def _max_body_bytes(self, tokens: int) -> int:
        raise NotImplementedError

    def _encode_body(self, chunk: torch.Tensor) -> bytes | bytearray | memoryview:
        raise NotImplementedError

    def _decode_body(self, body: memoryview, tokens: int, device: torch.device) -> torch.Tensor:
        """The decoded chunk, in the chunk dtype or float32 (the caller casts)."""
        raise NotImplementedError

    def _check_shape(self, shape: tuple[int, ...], what: str) -> int:
        ok = (
            len(shape) == 5
            and shape[:2] == self.shape[:2]
            and shape[3:] == self.shape[3:]
            and 1 <= shape[2] <= self.shape[2]
        )
        if not ok:
            raise ValueError(f"{what} shape {shape} does not fit the codec's {self.shape} (tokens may be fewer)")
        return int(shape[2])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec}, shape={self.shape}, dtype={self.dtype_name})"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]


def bytes_tensor(buf: bytes | bytearray | memoryview, count: int | None = None) -> torch.Tensor:
    """A uint8 CPU tensor over ``buf`` (no copy; read-only data must not be written)."""
    view = memoryview(buf).cast("B")
    if count is not None and len(view) != count:
        raise CodecError(f"encoded chunk section is {len(view)} bytes, expected {count}")
    if len(view) == 0:
        return torch.empty(0, dtype=torch.uint8)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # frombuffer over read-only bytes: we only read it
        return torch.frombuffer(view, dtype=torch.uint8)


class NoneCodec(Codec):
    """Mode ``none``: the frame is the raw chunk bytes, without header or checksum.

    The daemon's own checksums cover raw chunks; adapters do not call a codec
    for ``none`` at all.  ``decode`` takes the token count from ``out``.
    """

    def max_encoded_bytes(self, tokens: int) -> int:
        return self.raw_bytes(tokens)

    def encode(self, chunk: torch.Tensor) -> bytes:
        self._check_shape(tuple(chunk.shape), "chunk")
        if chunk.dtype != self.dtype:
            raise ValueError(f"chunk dtype {chunk.dtype} differs from the codec's {self.dtype}")
        return bytes(tensor_bytes(chunk.detach().cpu()))

    def decode(self, buf: bytes | bytearray | memoryview, out: torch.Tensor) -> None:
        tokens = self._check_shape(tuple(out.shape), "out")
        data = bytes_tensor(buf)
        if data.numel() != self.raw_bytes(tokens):
            raise CodecError(f"raw chunk is {data.numel()} bytes, expected {self.raw_bytes(tokens)}")
        out.copy_(data.view(self.dtype).view(out.shape))

    def decode_tensor(self, buf: bytes | bytearray | memoryview, device: Any = "cpu") -> torch.Tensor:
        data = bytes_tensor(buf)
        per_token = self.raw_bytes(1)
        if data.numel() == 0 or data.numel() % per_token or data.numel() // per_token > self.shape[2]:
            raise CodecError(f"raw chunk of {data.numel()} bytes is no whole number of tokens of {self.shape}")
        shape = (*self.shape[:2], data.numel() // per_token, *self.shape[3:])
        tokens_first = data.view(self.dtype).view(self.shape[0], 2, -1, *self.shape[3:])
        return tokens_first.reshape(shape).to(device=device, copy=True)
