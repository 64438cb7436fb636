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
class HeapRelease:
    """What one release did: the process's resident bytes before and after, how long it
    took, and whether it ran (``malloc_trim`` is glibc's: elsewhere nothing is done)."""

    rss_before_bytes: int
    rss_after_bytes: int
    trimmed: bool
    seconds: float = 0.0

    @property
    def released_bytes(self) -> int:
        return max(0, self.rss_before_bytes - self.rss_after_bytes)

    def to_json(self) -> dict[str, int | bool | float]:
        return {"rss_before_bytes": self.rss_before_bytes,
                "rss_after_bytes": self.rss_after_bytes,
                "heap_released_bytes": self.released_bytes,
                "heap_trimmed": self.trimmed, "heap_trim_s": round(self.seconds, 4)}  # fmt: skip


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
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the C library loaded
    except OSError:
        trim = None
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim(0)
    return HeapRelease(before, resident_bytes(), trim is not None, time.perf_counter() - t0)
