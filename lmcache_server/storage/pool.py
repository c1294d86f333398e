"""The memory pool: one anonymous mapping of the configured size, made once at start.

Pages are committed by the kernel on first touch, so RSS grows with use up to
the configured size and never beyond it.  Where a CUDA device is present the
whole mapping is page-locked with ``cudaHostRegister`` so engines can DMA
from it; elsewhere the daemon logs one line and goes on unpinned.

Primitives: :class:`MemoryPool` (``view``, ``address``, ``pinned``, ``close``).
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import logging
import mmap

logger = logging.getLogger(__name__)

_CUDART_NAMES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")


class PinningError(RuntimeError):
    """pin_memory=on was asked for but the pool could not be page-locked."""


class MemoryPool:
    def __init__(self, size: int, pin_memory: str = "auto"):
        self.size = size
        self._mmap = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                # Fewer page faults and TLB misses when copying MiB-sized chunks.
                self._mmap.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self.view = memoryview(self._mmap)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))
        self._unregister: object | None = None
        self.pinned = False
        if pin_memory != "off":
            reason = self._try_pin()
            if not self.pinned:
                if pin_memory == "on":
                    self.close()
                    raise PinningError(f"pin_memory=on but the pool could not be page-locked: {reason}")
                logger.info("memory pool not page-locked (%s); GPU clients copy through pageable memory", reason)

    def _try_pin(self) -> str:
        if not glob.glob("/dev/nvidia[0-9]*"):
            return "no CUDA device on this host"
        for name in _CUDART_NAMES:
            try:
                cudart = ctypes.CDLL(name)
            except OSError:
                continue
            rc = cudart.cudaHostRegister(ctypes.c_void_p(self.address), ctypes.c_size_t(self.size), 0)
            if rc == 0:
                self._unregister = lambda lib=cudart: lib.cudaHostUnregister(ctypes.c_void_p(self.address))
                self.pinned = True
                logger.info("memory pool page-locked with cudaHostRegister (%s)", name)
                return ""
            return f"cudaHostRegister returned error {rc}"
        if importlib.util.find_spec("torch") is not None:
            import torch

            if torch.cuda.is_available():
                rt = torch.cuda.cudart()  # type: ignore[no-untyped-call]
                rc = int(rt.cudaHostRegister(self.address, self.size, 0))
                if rc == 0:
                    self._unregister = lambda: rt.cudaHostUnregister(self.address)
                    self.pinned = True
                    logger.info("memory pool page-locked with cudaHostRegister (torch)")
                    return ""
                return f"cudaHostRegister returned error {rc}"
        return "no CUDA runtime found (libcudart or torch with CUDA)"

    def close(self) -> None:
        if self._unregister is not None:
            self._unregister()  # type: ignore[operator]
            self._unregister = None
        try:
            self.view.release()
            self._mmap.close()
        except BufferError:
            # A zero-copy send still references the pool; the mapping goes with the process.
            logger.debug("memory pool still referenced at close")
