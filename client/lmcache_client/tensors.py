"""torch helpers: chunk bytes <-> tensors without extra copies (torch is optional).

Primitives:

- :func:`tensor_bytes`: a zero-copy uint8 view of a contiguous CPU tensor, to put.
- :func:`copy_into`: one memcpy from a received buffer into a CPU tensor.
- :func:`as_tensor`: a tensor of the given dtype/shape over a received buffer
  (copied once, so the result is writable and owns its memory).
"""

from __future__ import annotations

import ctypes
from typing import Any


def _torch() -> Any:
    try:
        import torch
    except ImportError as err:  # pragma: no cover - exercised only without torch
        raise ImportError("tensor helpers need torch: pip install 'lmcache-client[torch]'") from err
    return torch


def _byte_view(tensor: Any) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's storage (no numpy needed).

    The view keeps the tensor alive: the ctypes array it wraps holds a reference.
    """
    nbytes = tensor.numel() * tensor.element_size()
    array = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    array._owner = tensor
    return memoryview(array).cast("B")


def tensor_bytes(tensor: Any) -> memoryview:
    """The bytes of a CPU tensor as a memoryview, without a copy when it is contiguous."""
    _torch()
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor is on {tensor.device}; move it to CPU (pinned) memory first")
    return _byte_view(tensor.detach().contiguous())


def copy_into(tensor: Any, buf: Any) -> bool:
    """Copy ``buf`` into a contiguous CPU tensor of exactly the same byte size."""
    _torch()
    src = memoryview(buf).cast("B")
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("copy_into needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if src.nbytes != nbytes:
        raise ValueError(f"chunk is {src.nbytes} bytes but the tensor holds {nbytes}")
    _byte_view(tensor)[:] = src
    return True


def as_tensor(buf: Any, dtype: Any, shape: tuple[int, ...] | None = None) -> Any:
    """A new tensor with ``buf``'s bytes, of ``dtype`` and optional ``shape``."""
    torch = _torch()
    src = memoryview(buf).cast("B")
    out = torch.empty(src.nbytes, dtype=torch.uint8)
    _byte_view(out)[:] = src
    result = out.view(dtype)
    return result.reshape(shape) if shape is not None else result
