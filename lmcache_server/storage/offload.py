"""Multi-MiB byte work off the event loop.

A 32 MiB chunk costs milliseconds to copy or checksum; eight of them on the
event loop stall every other request for tens of milliseconds.  Such work runs
here instead, in a few threads that release the GIL while they work:

- :func:`memcopy` copies with ``ctypes.memmove`` (a foreign call: ctypes
  drops the GIL for its duration), taking both addresses through the buffer
  protocol; a non-contiguous buffer falls back to a slice assignment.
- CRC32C (:func:`.chunkfile.checksum`, the ``crc32c`` package) drops the GIL on
  large buffers by itself.

Callers keep the buffers alive and unchanged until the awaited call returns
(a pool extent stays reserved or leased meanwhile).

Primitives: :func:`memcopy`, :func:`raw_buffer` (memory that is not zeroed
under the GIL), :class:`Offload` (``run``, ``copy``, ``close``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

SMALL_BYTES = 256 * 1024
"""Below this a copy stays where it is asked for: a thread hop costs more."""


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (stable ABI), to read any exporter's address."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_PyBUF_SIMPLE, _PyBUF_WRITABLE = 0, 1
_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


def _address(buf: Any, writable: bool) -> int | None:
    """The address of a C-contiguous buffer's first byte (read-only ones too,
    unless ``writable``), or None.  Valid while the caller keeps ``buf``."""
    view = _PyBuffer()
    try:
        _get_buffer(buf, ctypes.byref(view), _PyBUF_WRITABLE if writable else _PyBUF_SIMPLE)
    except (BufferError, TypeError, ValueError):
        return None
    try:
        return view.buf if view.len else None
    finally:
        _release_buffer(ctypes.byref(view))


def memcopy(dst: memoryview, src: Any) -> None:
    """``dst[:] = src`` for same-sized contiguous buffers, without holding the GIL when it can."""
    source = memoryview(src).cast("B")
    if source.nbytes != dst.nbytes:
        raise ValueError(f"copy of {source.nbytes} bytes into {dst.nbytes}")
    d = _address(dst, writable=True) if dst.nbytes >= SMALL_BYTES else None
    s = _address(source, writable=False) if d is not None else None
    if d is None or s is None:
        dst[:] = source
        return
    ctypes.memmove(d, s, dst.nbytes)


_libc = ctypes.CDLL(None)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.restype = None
_libc.free.argtypes = [ctypes.c_void_p]


def raw_buffer(nbytes: int) -> memoryview:
    """``nbytes`` of uninitialised memory (malloc), freed when the last view of it goes.

    ``bytearray(n)`` zeroes its memory while holding the GIL: 32 MiB of it
    (page faults included) stall every other thread, the event loop first.
    Here the allocation is a foreign call (no GIL), nothing is zeroed, and the
    pages fault in later, under the GIL-free copy that fills them.
    """
    address = _libc.malloc(max(nbytes, 1))
    if not address:
        raise MemoryError(f"cannot allocate {nbytes} bytes")
    array = (ctypes.c_char * max(nbytes, 1)).from_address(address)
    weakref.finalize(array, _libc.free, address)
    return memoryview(array).cast("B")[:nbytes]


class Offload:
    """A small thread pool for copies and checksums (``threads`` wide)."""

    def __init__(self, threads: int = 2, name: str = "lmcache-copy"):
        self.threads = threads
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def copy(self, dst: memoryview, src: Any) -> None:
        """:func:`memcopy` in a worker thread (at once when small)."""
        if dst.nbytes < SMALL_BYTES:
            memcopy(dst, src)
        else:
            await self.run(memcopy, dst, src)

    def close(self) -> None:
        """Wait for running work (it may be writing into pool memory) and stop the threads."""
        self._pool.shutdown(wait=True)
