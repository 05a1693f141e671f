"""The C heap (glibc malloc) while large indices load beside live traffic.

hnswlib builds an index in memory it allocates itself, copying into it with the GIL held.
Fresh memory is page-faulted in on first touch, and on the debian-deps bundle those faults
were two thirds of the copy (28 ms per index, 10 ms without them) - a stall for every request
in flight during a hot swap. `prefault(n)` touches n bytes and frees them again, with the GIL
released; once `tune_for_loads()` has made the heap keep freed memory (one arena, no
per-block mmap, no automatic trimming), the allocation that follows is carved from those
pages and the copy runs at memory speed. `trim()` then hands what is free back to the OS, so
the process's RSS still falls when a bundle is released.

Process-wide by nature (there is one heap); everything here is a no-op off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("shortlist.heap")

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
# mallopt takes an int: the largest trim threshold, hence the largest block `prefault` can
# hand on (a larger freed block is returned to the OS at once, so touching it would be waste).
_TRIM_THRESHOLD = 2**31 - 1


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is None or not all(hasattr(libc, f) for f in ("mallopt", "malloc_trim", "malloc")):
            return None
    except OSError:
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.restype = ctypes.c_void_p
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


_LIBC = _libc()
_tuned = False


def tune_for_loads() -> bool:
    """Make freed memory reusable by the next allocation of any size; True if applied.

    One arena: the loader thread's frees and hnswlib's allocations meet in the same heap
    (a thread arena also unmaps a heap the moment it is empty). No mmap per large block:
    glibc caps that threshold at 32 MiB, below an index's size, and an unmapped block comes
    back as fresh pages. No automatic trimming: `trim()` is called when a load or a release
    is done.
    """
    global _tuned
    if _LIBC is None:
        return False
    ok = all(_LIBC.mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)))
    if not ok:
        log.warning("mallopt refused a setting; bundle loads will page-fault with the GIL held")
    _tuned = ok
    return ok


def prefault(nbytes: int) -> None:
    """Touch and free `nbytes` of heap so the allocations that follow find them resident."""
    if not _tuned or not 0 < nbytes < _TRIM_THRESHOLD:
        return
    # ctypes releases the GIL around each foreign call: the page faults happen here, off it.
    block = _LIBC.malloc(nbytes)
    if block:
        _LIBC.memset(block, 0, nbytes)
        _LIBC.free(block)


def trim() -> None:
    """Return free heap memory to the OS (no-op off glibc)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
