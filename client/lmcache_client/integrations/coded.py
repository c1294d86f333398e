"""The KV codec path of :class:`~.transfer.ChunkTransfer`: which codec, and the bytes.

The daemon announces in ``hello`` the codec engines encode with (its
``kv_codec`` setting; docs/codec.md).  A transfer built with a ``codec_layout``
asks once, on first use, and binds to one of:

- **raw**: no codec announced (or ``none``, or a lossy codec for an adapter
  whose payloads are not in the L2THD layout: SGLang's host pages): raw
  payloads in the adapter's own namespace, as before;
- **coded**: a codec it can build: payloads are encoded on put and decoded
  on get, under the namespace with ``codec=<tag>``, so encoded and raw
  chunks, and two codec settings, never mix;
- **off**: a codec it cannot build (the ``zstandard`` package missing, a mode
  or frame version from a newer daemon): it logs once and caches nothing.
  It never reads or writes that codec's namespace, and does not fall back to
  the raw one either: an operator who asked for a codec would otherwise get
  a cache filled at the raw size without noticing.

A frame that does not decode (damaged, truncated, or garbage another client
stored under a codec namespace key) is a miss that ends the prefix there,
counted in ``codec_errors`` and logged once per transfer; the codec checks
each frame's checksum, so it never hands out wrong bytes.

Primitives: :class:`CodecBinding` (``resolve``) and :class:`CodedChunks`
(scratch buffers and the encode/decode steps the transfer wraps around the
client's calls).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..namespace import Namespace
from .chunklayout import ChunkLayout

logger = logging.getLogger(__name__)


def _torch() -> Any:
    import torch

    return torch


@dataclasses.dataclass(frozen=True)
class CodecBinding:
    """What a transfer does: ``namespace`` None caches nothing (off); ``coded`` None is raw."""

    namespace: str | None
    coded: CodedChunks | None = None

    @classmethod
    def resolve(
        cls, announced: Mapping[str, Any] | None, base: Namespace, layout: ChunkLayout, *, lossy_ok: bool = True
    ) -> CodecBinding:
        """The binding for the daemon's announced codec (``hello["codec"]``)."""
        if not announced:
            return cls(base.wire())
        try:
            from ..codec import CodecSpec, make_codec

            spec = CodecSpec.from_dict(announced)
        except (ImportError, ValueError, TypeError) as err:
            logger.warning(
                "lmcache: the daemon announces KV codec %r, which this client cannot use (%s); "
                "caching nothing (the codec's chunks are never read as raw)",
                announced,
                err,
            )
            return cls(None)
        if spec.mode == "none":
            return cls(base.wire())
        if spec.lossy and not lossy_ok:
            logger.warning(
                "lmcache: the daemon announces the lossy KV codec %s, which needs payloads in the "
                "(layers, 2, tokens, heads, dim) layout; this adapter's are not (%s): storing raw chunks",
                spec,
                base.layout,
            )
            return cls(base.wire())
        torch = _torch()
        try:
            codec = make_codec(spec, layout.shape, getattr(torch, layout.dtype))
        except (ImportError, ValueError, TypeError) as err:
            logger.warning(
                "lmcache: cannot build the KV codec %s the daemon announces (%s); caching nothing", spec, err
            )
            return cls(None)
        namespace = dataclasses.replace(base, codec=spec.tag).wire()
        logger.info("lmcache: KV codec %s, namespace %s", spec, namespace)
        return cls(namespace, CodedChunks(codec, layout))


class CodedChunks:
    """Encode and decode the payloads of one :class:`ChunkLayout` with one codec."""

    def __init__(self, codec: Any, layout: ChunkLayout):
        self.codec = codec
        self.layout = layout
        self.token_bytes = layout.nbytes // layout.chunk_size
        self.errors = 0
        """Frames that did not decode (each one a miss)."""
        self._scratch: Any = None

    @property
    def lossy(self) -> bool:
        return bool(self.codec.spec.lossy)

    def tokens_of(self, nbytes: int) -> int:
        """Tokens in a raw payload of ``nbytes`` (ValueError when it is no whole number of them)."""
        tokens, rest = divmod(nbytes, self.token_bytes)
        if rest or not 0 < tokens <= self.layout.chunk_size:
            raise ValueError(f"a payload of {nbytes} bytes is no whole number of tokens of {self.layout}")
        return tokens

    def _shape(self, tokens: int) -> tuple[int, ...]:
        shape = list(self.layout.shape)
        shape[2] = tokens
        return tuple(shape)

    def raw_tensor(self, payload: Any) -> Any:
        """A tensor view ``(layers, 2, tokens, heads, dim)`` over a raw payload's bytes."""
        torch = _torch()
        if isinstance(payload, torch.Tensor):
            flat = payload.detach().reshape(-1).view(torch.uint8)
        else:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only buffers: only read here
                flat = torch.frombuffer(memoryview(payload).cast("B"), dtype=torch.uint8)
        tokens = self.tokens_of(flat.numel())
        return flat.view(self.codec.dtype).view(self._shape(tokens))

    def encode(self, payload: Any) -> bytes:
        """One frame for a raw payload (bytes-like or tensor) of whole tokens."""
        return bytes(self.codec.encode(self.raw_tensor(payload)))

    def encode_filled(self, nbytes: int, fill: Callable[[memoryview], None]) -> bytes:
        """Let ``fill`` write a raw payload of ``nbytes`` into scratch memory, then encode it."""
        scratch = self.scratch(nbytes)
        fill(scratch_view(scratch))
        return self.encode(scratch)

    def scratch(self, nbytes: int) -> Any:
        """A reused CPU byte tensor of ``nbytes`` (its first bytes of the largest asked)."""
        torch = _torch()
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = torch.empty(max(nbytes, self.layout.nbytes), dtype=torch.uint8)
        return self._scratch[:nbytes]

    def decode_raw(self, frame: Any, nbytes: int) -> memoryview | None:
        """The raw payload of a frame that must decode to exactly ``nbytes`` (a view of
        scratch memory, valid until the next call), None when it does not."""
        scratch = self.scratch(nbytes)
        if not self.decode_into(frame, scratch):
            return None
        return scratch_view(scratch)

    def decode_into(self, frame: Any, dest: Any) -> bool:
        """Decode ``frame`` into ``dest`` (a tensor or writable buffer of the raw payload's
        size); False (counted, logged once) when it is not a valid frame of that size."""
        from ..codec import CodecError

        torch = _torch()
        try:
            if isinstance(dest, torch.Tensor):
                if dest.is_contiguous() and dest.dtype == self.codec.dtype:
                    out = dest.view(self._shape(self.tokens_of(dest.numel() * dest.element_size())))
                    self.codec.decode(frame, out)
                    return True
                decoded = self.codec.decode_tensor(frame, device=dest.device)
                raw = decoded.reshape(-1).view(torch.uint8)
                target = dest.reshape(-1).view(torch.uint8) if dest.is_contiguous() else None
                if target is None or target.numel() != raw.numel():
                    raise CodecError(f"decoded chunk is {raw.numel()} bytes; the destination is not")
                target.copy_(raw)
                return True
            view = memoryview(dest).cast("B")
            decoded = self.codec.decode_tensor(frame)
            raw = decoded.reshape(-1).view(torch.uint8)
            if raw.numel() != len(view):
                raise CodecError(f"decoded chunk is {raw.numel()} bytes, expected {len(view)}")
            torch.frombuffer(view, dtype=torch.uint8).copy_(raw)
            return True
        except (CodecError, ValueError) as err:  # a damaged or foreign frame: a miss
            self.errors += 1
            log = logger.warning if self.errors == 1 else logger.debug
            log("lmcache: a stored chunk does not decode (%s); treating it and what follows as a miss", err)
            return False


def scratch_view(tensor: Any) -> memoryview:
    """A writable byte view of a contiguous CPU uint8 tensor."""
    return memoryview(tensor.numpy()).cast("B")


def encode_all(coded: CodedChunks, payloads: Sequence[Any]) -> list[bytes]:
    """Frames for raw payloads."""
    return [coded.encode(p) for p in payloads]
