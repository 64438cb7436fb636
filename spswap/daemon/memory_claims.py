"""Memory for the trees that early restores bring back (:mod:`spswap.daemon.prerestore`).

CRIU's restore of an image fills the restored tree's memory page by page over a second or
two; until it is done the kernel's MemAvailable does not show it. Two jobs whose prologs
run at once (a high job's end requeues several) would each see the same free memory, so
each early restore claims its image's size here first, and the next one is judged on
what is left. A claim ends when its restore does (its pages then count in MemAvailable).
No torch, CUDA or Slurm: bookkeeping, tested on CPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

MEMORY_MARGIN_BYTES = 2 << 30  # left free beside the tree and its image


def refusal(*, image_bytes: int, available_bytes: int | None) -> str | None:
    """Why an image is not restored early for lack of memory, or None. Pure."""
    if available_bytes is None:
        return "the free memory is not known"
    needed = image_bytes + MEMORY_MARGIN_BYTES
    if available_bytes < needed:
        return (f"not enough free memory for the tree beside its image ({needed >> 20} MiB "
                f"needed, {max(available_bytes, 0) >> 20} MiB available)")  # fmt: skip
    return None


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's MemAvailable, in bytes; None when it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class MemoryClaims:
    """The bytes early restores under way will take; thread-safe (prologs run at once)."""

    def __init__(self, available: Callable[[], int | None] = mem_available_bytes) -> None:
        self._available = available
        self._lock = threading.Lock()
        self._claimed_bytes = 0

    @property
    def claimed_bytes(self) -> int:
        with self._lock:
            return self._claimed_bytes

    def short(self, image_bytes: int) -> str | None:
        """Why ``image_bytes`` would not be claimed now, or None; claims nothing (a cheap
        look before the image's own check, which may read the whole image)."""
        with self._lock:
            return self._judge(image_bytes)

    def _judge(self, image_bytes: int) -> str | None:  # (under self._lock)
        available = self._available()
        if available is not None:
            available -= self._claimed_bytes
        return refusal(image_bytes=image_bytes, available_bytes=available)

    @contextlib.contextmanager
    def claim(self, image_bytes: int) -> Iterator[str | None]:
        """Yields None with ``image_bytes`` claimed until the block ends, or why not (then
        nothing is claimed): the free memory less what other restores claimed."""
        with self._lock:  # judged and taken under one lock
            why = self._judge(image_bytes)
            if why is None:
                self._claimed_bytes += image_bytes
        try:
            yield why
        finally:
            if why is None:
                with self._lock:
                    self._claimed_bytes -= image_bytes
