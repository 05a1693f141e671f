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

Huge pages for an index (`huge_pages`, Linux): an HNSW search reads ~50 nodes' neighbour lists
and ~2,400 vectors (1 KiB each at D = 256) scattered over the graph's whole block (52 MiB on
debian-deps): with 4 KiB pages nearly every vector read is a TLB miss, and in a virtual machine
each miss walks two levels of page tables. The block hnswlib copied an index into is found as
the anonymous memory the load mapped, advised for transparent huge pages and collapsed into them
(MADV_COLLAPSE, Linux 6.1+; before that khugepaged does it in the background); then 26 pages
cover it and its searches stop missing the TLB (bench/RESULTS.md, issue 22). The graph is only
read once loaded, so processes forked after a preload share its huge pages as they shared the
small ones.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np

T = TypeVar("T")

log = logging.getLogger("shortlist.heap")

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
# mallopt takes an int: the largest trim threshold, hence the largest block `prefault` can
# hand on (a larger freed block is returned to the OS at once, so touching it would be waste).
_TRIM_THRESHOLD = 2**31 - 1
# resident_copy copies this many bytes of rows at a time.
RESIDENT_COPY_BYTES = 4 << 20


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
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
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


# madvise advice (asm-generic/mman-common.h)
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KiB granule) PMD size
_MAPS = Path("/proc/self/maps")
_huge_pages = sys.platform == "linux"


def use_huge_pages(enabled: bool) -> None:
    """Whether loads give an index's memory huge pages from now on (`in_huge_pages`, `resident_copy`);
    on by default on Linux."""
    global _huge_pages
    _huge_pages = enabled and sys.platform == "linux"


def huge_pages() -> bool:
    return _huge_pages and _LIBC is not None


def resident_copy(values: np.ndarray, copied: Callable[[int, int], None] | None = None) -> np.ndarray:
    """A copy of `values` (a file map's rows, [n, ...]) in this process's memory, advised for huge pages
    before it is written, so that it is faulted in as huge pages where the kernel has them.
    copied(start, stop): called after each piece of rows is copied (RESIDENT_COPY_BYTES), e.g.
    to hand back the map's pages of those rows, so the copy never holds the whole map too."""
    out = np.empty(values.shape, dtype=values.dtype)
    if huge_pages() and out.nbytes >= 2 * _HUGE_PAGE:
        start = out.__array_interface__["data"][0]
        first = -(-start // _HUGE_PAGE) * _HUGE_PAGE
        length = ((start + out.nbytes) // _HUGE_PAGE) * _HUGE_PAGE - first
        if length > 0:
            _LIBC.madvise(first, length, _MADV_HUGEPAGE)
    rows = max(1, RESIDENT_COPY_BYTES // max(1, out[:1].nbytes))
    for start in range(0, len(out), rows):
        stop = min(start + rows, len(out))
        np.copyto(out[start:stop], values[start:stop])
        if copied is not None:
            copied(start, stop)
    return out


def in_huge_pages(load: Callable[[], T], nbytes: int) -> T:
    """load(), which allocates a block of about `nbytes` and fills it; then the anonymous memory
    it mapped, in pieces of at least `nbytes` (the block, not a concurrent request's buffers), is
    given transparent huge pages where the kernel has them. Best effort: any refusal leaves the
    memory as it was."""
    if not huge_pages() or nbytes < 2 * _HUGE_PAGE:
        return load()
    before = _anonymous_ranges()
    out = load()
    if before is not None:
        for start, end in _new_ranges(before, _anonymous_ranges() or []):
            if end - start >= nbytes:
                _collapse(start, end)
    return out


def _anonymous_ranges() -> list[tuple[int, int]] | None:
    """The process's anonymous read-write private mappings (the malloc heap's included), sorted."""
    try:
        lines = _MAPS.read_text().splitlines()
    except OSError:
        return None
    out = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) >= 5 and fields[1].startswith("rw") and fields[4] == "0" and (
                len(fields) == 5 or fields[5].strip() == "[heap]"):
            start, end = fields[0].split("-")
            out.append((int(start, 16), int(end, 16)))
    return sorted(out)


def _new_ranges(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of `after`'s ranges that no range of `before` covers (mappings can merge or grow)."""
    out = []
    for start, end in after:
        pos = start
        for b_start, b_end in before:
            if b_end <= pos or b_start >= end:
                continue
            if b_start > pos:
                out.append((pos, b_start))
            pos = max(pos, b_end)
        if pos < end:
            out.append((pos, end))
    return out


def _collapse(start: int, end: int) -> None:
    """Huge pages for the whole 2 MiB pages inside [start, end): advised, then collapsed now."""
    first = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    length = (end // _HUGE_PAGE) * _HUGE_PAGE - first
    if length <= 0:
        return
    # ctypes releases the GIL around each call: the collapse's copy does not stall requests.
    if _LIBC.madvise(first, length, _MADV_HUGEPAGE) != 0:
        return
    if _LIBC.madvise(first, length, _MADV_COLLAPSE) != 0:
        log.debug("MADV_COLLAPSE refused (%d bytes): khugepaged collapses them in time", length)
