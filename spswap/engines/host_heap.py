"""Hand a process's freed heap memory back to the kernel before its checkpoint.

glibc's ``free`` gives back only the top of the heap; memory freed in its middle stays
resident, and CRIU dumps and restores every resident page (a restore fills them at ~2
GB/s, on the restore's critical path). A model process can leave much of that behind:
the host copies of a load or a pool export (tensors of a few MiB come from the heap once
glibc's mmap threshold has risen to their size). ``malloc_trim(0)`` releases the free
pages of every arena and keeps every live byte. (On the H200, a 3B vLLM engine that had
loaded from disk gave back 10 MB of its 8.6 GB resident, `STEPS=asleep ASLEEP_SIZES=3b`
of scripts/gpu/run_vllm.sh; what a served engine gives back shows in its image's heap,
`spswap images show`.)

No torch, no CUDA: called after a sleep in vLLM's engine process (``spswap_trim``), in
spswap serve's own process and in each multi-model worker. vLLM's API server process is
not spswap's code and keeps its heap as it is.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class MallocStats:
    """What glibc's allocator holds, over all its arenas (``mallinfo2``): the bytes of
    live blocks, of free blocks it keeps (resident where touched: CRIU dumps those
    pages), and of the blocks it mapped on their own (large ones: each an anonymous
    mapping in an image, not the heap). What else a process's image holds as anonymous
    memory is not malloc's (Python's own small-object arenas, a CUDA checkpoint's copy of
    the GPU state, thread stacks)."""

    in_use_bytes: int
    free_bytes: int
    mmapped_bytes: int

    def to_json(self) -> dict[str, int]:
        return {"malloc_in_use_bytes": self.in_use_bytes, "malloc_free_bytes": self.free_bytes,
                "malloc_mmapped_bytes": self.mmapped_bytes}  # fmt: skip


@dataclass(frozen=True)
class HeapRelease:
    """What one release did: the process's resident bytes before and after, how long it
    took, whether it ran (``malloc_trim`` is glibc's: elsewhere nothing is done) and
    what the allocator held after it (None: not glibc, or one before 2.33)."""

    rss_before_bytes: int
    rss_after_bytes: int
    trimmed: bool
    seconds: float = 0.0
    malloc_after: MallocStats | None = None

    @property
    def released_bytes(self) -> int:
        return max(0, self.rss_before_bytes - self.rss_after_bytes)

    def to_json(self) -> dict[str, int | bool | float]:
        out: dict[str, int | bool | float] = {
            "rss_before_bytes": self.rss_before_bytes, "rss_after_bytes": self.rss_after_bytes,
            "heap_released_bytes": self.released_bytes,
            "heap_trimmed": self.trimmed, "heap_trim_s": round(self.seconds, 4)}  # fmt: skip
        if self.malloc_after is not None:
            out.update(self.malloc_after.to_json())
        return out


class _Mallinfo2(ctypes.Structure):
    # glibc's struct mallinfo2 (malloc.h), every field a size_t
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]  # fmt: skip


def malloc_stats(libc: ctypes.CDLL | None = None) -> MallocStats | None:
    """glibc's ``mallinfo2()`` for this process (all arenas); None without it."""
    try:
        lib = libc if libc is not None else ctypes.CDLL(None)
        info = getattr(lib, "mallinfo2", None)
    except OSError:
        return None
    if info is None:
        return None
    info.restype = _Mallinfo2
    m = info()
    return MallocStats(in_use_bytes=int(m.uordblks), free_bytes=int(m.fordblks),
                       mmapped_bytes=int(m.hblkhd))  # fmt: skip


def resident_bytes() -> int:
    """This process's resident set in bytes (``/proc/self/statm``'s second field)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def release_free_heap() -> HeapRelease:
    """Give the heap's free pages back to the kernel (``malloc_trim(0)``); live memory
    is untouched. Safe at any time and from any thread (glibc locks each arena); meant
    for just before a checkpoint. Never raises for a C library without it."""
    t0 = time.perf_counter()
    before = resident_bytes()
    try:
        libc: ctypes.CDLL | None = ctypes.CDLL(None)  # the C library loaded
    except OSError:
        libc = None
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim(0)
    seconds = time.perf_counter() - t0
    stats = malloc_stats(libc) if libc is not None else None  # (the same library, once)
    return HeapRelease(before, resident_bytes(), trim is not None, seconds, stats)
