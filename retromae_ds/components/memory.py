"""Freed memory goes back to the operating system after every optimizer step.

A training step allocates and frees hundreds of tensors whose sizes change with every batch
(variable lengths, the vocabulary head's chunks, collation buffers). glibc's allocator keeps
the pages of freed blocks in its heaps for reuse. Its adaptive mmap threshold also moves large
blocks into those heaps after the first ones are freed, so the heaps fragment. A tiny RetroMAE
run grew ~18 MiB a step with no plateau (697 -> 2,504 MiB in 100 steps,
benchmarks/bench_memory.py). ``malloc_trim(0)`` after each step hands the free pages back:
the same run stayed at 461-476 MiB at the same speed. Linux with glibc only; elsewhere (musl,
macOS) it does nothing. ``RETROMAE_DS_MALLOC_TRIM=0`` turns it off (the benchmark's
baseline).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux") or os.environ.get("RETROMAE_DS_MALLOC_TRIM") == "0":
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)  # glibc's; musl has none
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """Return the allocator's free pages to the OS; False where that is not available."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
