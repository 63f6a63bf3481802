"""Handing freed native memory back to the operating system (glibc's ``malloc_trim``), in both
services.

glibc serves an allocation from a free region of its heap when one is large enough, keeps what a
thread frees in that thread's malloc arena, and raises its mmap threshold after a big block is
freed, so freed memory often stays in the process:
- engine: sleep mode frees the KV cache so that other processes can have the memory; one of four
  64 MiB KV tensors was measured staying resident (a test run where earlier tests had left a large
  free region in the heap);
- gateway: big requests (a multi-megabyte prompt tokenized in a worker thread, a body of millions
  of token ids, a 16 MB /tokenize answer) left its RSS at their peak: 57 -> 513 MB after four
  3 MB prompts, measured; ``malloc_trim(0)`` returned it (-> 60-80 MB in the same measurement).
Elsewhere (musl, macOS) this is a no-op.
"""

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
    """Return freed native memory to the OS where the C library can (ctypes drops the GIL for
    the call; it can take milliseconds on a large heap, so keep it off an event loop)."""
    if _malloc_trim is not None:
        _malloc_trim(0)
