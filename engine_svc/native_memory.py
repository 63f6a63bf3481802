"""Handing freed host memory back to the operating system (glibc's ``malloc_trim``).

A big tensor freed on the CPU goes back to the process's allocator, not always to the system:
glibc serves an allocation from a free region of its heap when one is large enough, and a block
freed there stays in the process. Sleep mode frees the KV cache so that other processes can
have the memory: one of four 64 MiB KV tensors was measured staying resident that way (a test
run where earlier tests had left a large free region in the heap). Elsewhere (musl, macOS) this
is a no-op."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    return trim


_malloc_trim = _load_malloc_trim()


def trim_heap() -> None:
    """Return the allocator's free memory to the system where the C library can."""
    if _malloc_trim is not None:
        _malloc_trim(0)
