"""Output buffers of the DSSST1 codec: large frames are allocated without zero-filling and reused per thread.

A speed layer only: every byte of a buffer handed out here is overwritten before a frame is exposed."""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from typing import Any, Final


def _uninitialized_allocator() -> Any:
    """``n -> bytearray`` whose bytes are NOT initialized, backed by huge pages when large.

    A fresh 80 MB ``bytearray(n)`` costs more than the copy into it: ``n`` zero bytes written over
    ~20k freshly faulted 4 KiB pages. Our frames overwrite every byte anyway, so on CPython/Linux
    an empty bytearray is grown with the C API ``PyByteArray_Resize`` (no zero-fill) and advised
    ``MADV_HUGEPAGE`` before its first touch (numpy does the same for its arrays): encoding gets
    about 3-4x faster. Elsewhere it falls back to ``bytearray(n)``.
    """
    try:
        if sys.implementation.name != "cpython" or not hasattr(mmap, "MADV_HUGEPAGE"):
            raise OSError("not CPython on Linux")
        resize = ctypes.pythonapi.PyByteArray_Resize
        resize.restype, resize.argtypes = ctypes.c_int, (ctypes.py_object, ctypes.c_ssize_t)
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.restype, madvise.argtypes = ctypes.c_int, (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (OSError, AttributeError):
        return bytearray
    page = mmap.PAGESIZE

    def allocate(n: int) -> bytearray:
        buf = bytearray()
        if n:
            resize(buf, n)  # raises MemoryError on failure
        if n >= _LARGE:  # advice is a hint: failure only costs speed
            start = ctypes.addressof((ctypes.c_char * n).from_buffer(buf))
            first, last = -(-start // page) * page, (start + n) // page * page
            madvise(first, last - first, mmap.MADV_HUGEPAGE)
        return buf

    return allocate


class _ReusedBuffers:
    """``n -> bytearray`` that hands a thread its previous large buffer again once nobody holds it.

    Fresh large buffers are what makes a round trip slow now and then: their pages are new to the
    process, and faulting them in (huge pages, or memory the kernel or hypervisor must first find
    and clear) took 140-250 ms per 84 MB frame in bursts, while rewriting memory the process
    already has takes ~20 ms. So each thread keeps its last buffer of at least ``_LARGE`` bytes;
    the next request reuses it (resized in place) when its only reference is this cache -- the
    caller dropped the frame, and no decoded tensor or memoryview still exports it. Otherwise a
    fresh buffer is made and cached instead, so a thread holds at most one idle buffer, of the
    size it last asked for. The "only reference" test is a reference count compared with one
    measured here for a buffer known to be unshared, so it does not depend on how the interpreter
    counts its own temporaries; without a GIL (free-threaded builds) nothing is reused.
    """

    def __init__(self, fresh: Any) -> None:
        self._fresh = fresh
        self._local = threading.local()
        self._resize = None
        gil = getattr(sys, "_is_gil_enabled", lambda: True)()
        if sys.implementation.name == "cpython" and gil and fresh is not bytearray:
            self._resize = ctypes.pythonapi.PyByteArray_Resize
            self._local.buf = bytearray(1)
            self._unshared = self._references()  # the count of a buffer only this cache holds
            self._local.buf = None

    def _references(self) -> int:
        return sys.getrefcount(self._local.buf)

    def __call__(self, n: int) -> bytearray:
        if n < _LARGE or self._resize is None:
            return self._fresh(n)
        if getattr(self._local, "buf", None) is not None and self._references() == self._unshared:
            buf = self._local.buf
            try:
                self._resize(buf, n)  # in place below the allocation; realloc (pages kept) above it
                return buf
            except (MemoryError, BufferError):
                pass
        self._local.buf = None  # let go of the idle buffer before making a new one
        buf = self._fresh(n)
        self._local.buf = buf
        return buf


_LARGE: Final = 4 << 20
# callers must overwrite every byte before exposing it
new_buffer = _ReusedBuffers(_uninitialized_allocator())
