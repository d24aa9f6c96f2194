"""Allocator settings for processes that receive large messages.

glibc's malloc serves every allocation above its mmap threshold (at most 32 MiB by default)
with a fresh ``mmap`` and gives it back with ``munmap`` on free. A process that receives a
64 MB trajectory group every few hundred milliseconds then pays a page fault for every 4 KiB
of every receive buffer, and libzmq's receive buffers are exactly such allocations. Raising
the mmap threshold and the trim threshold keeps freed memory in the heap, so the next
message's buffers reuse pages that are already mapped: on the 2-core development machine
this took tcp loopback from about 1.1 to 2.0 GB/s and the receiver's CPU time per 64 MB
message from 48 to 18 ms (``benchmarks/transport.py``, docs/benchmarks.md "Transport").

The price is resident memory: the heap keeps the high-water mark of what the process held
at once (about two messages for a receiver), instead of returning it to the kernel.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 1 << 30  # allocations below 1 GiB come from the heap
TRIM_THRESHOLD = (1 << 31) - 1  # keep up to 2 GiB of freed heap (mallopt takes an int)
OPT_OUT = "OMNIRL_SYSTEM_MALLOC"  # set to 1 to leave the allocator as it is


def retain_freed_memory() -> bool:
    """Make glibc keep freed large blocks for reuse; returns whether it took effect.

    A no-op (``False``) on a C library without ``mallopt`` (musl, macOS) or when the
    environment variable ``OMNIRL_SYSTEM_MALLOC=1`` is set. Call it once, at process start.
    """
    if os.environ.get(OPT_OUT, "") not in ("", "0"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
