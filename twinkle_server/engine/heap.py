"""Freed C-heap memory handed back to the OS once enough of it sits free.

On a CPU a pass's tensors come from glibc's malloc, and results outlive their pass (the
HTTP front keeps each op's result for retries, a sample's tokens wait for their client):
small live chunks between a pass's freed tensors. glibc returns only the top of a heap
to the OS, so without this each op left the process about 2 MiB bigger (a 400-op
flood of 8 x 32-token forward_backward ops took the server from 0.6 to 2 GiB, though
nothing held that memory). `trim` asks glibc (`malloc_trim`) to release the free pages
inside its heaps once the process has grown well past what it held after the last trim
(`Trimmer`): a trim costs about as much as re-faulting the pages the next pass takes, so
it runs rarely, not after every pass. Off glibc (macOS, musl) it does
nothing; accelerator memory is the device allocator's, not this.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

SLACK_BYTES = 128 * 2**20
"""Growth of the process past what it held after its last trim (and past twice what one
pass needs, measured after it) that triggers the next trim."""


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc with `mallinfo2` (2.33 and later) and `malloc_trim`, or None."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not hasattr(libc, "mallinfo2") or not hasattr(libc, "malloc_trim"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    return libc


def free_bytes() -> int | None:
    """Bytes free inside the C heaps now (all arenas), or None off glibc."""
    libc = _glibc()
    return None if libc is None else int(libc.mallinfo2().fordblks)


def resident_bytes() -> int | None:
    """This process's resident memory (Linux), or None."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class Trimmer:
    """Trims the heap when the process has grown past what it held after its last trim
    by more than `slack` and twice what the first pass after that trim took (that pass's
    working set, which the next passes reuse: trimming it away would only make them
    fault it back in)."""

    def __init__(self, slack: int = SLACK_BYTES) -> None:
        self.slack = slack
        self.floor: int | None = None        # resident bytes after the last trim
        self.working: int | None = None      # what the first pass after it added
        self.trims = 0

    def after_pass(self) -> bool:
        """Call after each pass; True when it trimmed."""
        rss = resident_bytes()
        if rss is None or _glibc() is None:
            return False
        if self.floor is None:
            self.floor = rss
            return False
        if self.working is None:
            self.working = max(0, rss - self.floor)
        if rss <= self.floor + max(self.slack, 2 * self.working):
            return False
        _glibc().malloc_trim(0)   # type: ignore[union-attr]
        self.trims += 1
        self.floor, self.working = resident_bytes(), None
        return True
