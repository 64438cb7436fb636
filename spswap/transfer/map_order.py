"""In which order a level-2-asleep engine's weight memory is mapped again so that the
staged copy from the pool can start at once (issue 18, item 1: the copy overlapped with
the mapping of the next tensors).

vLLM's sleep-mode allocator hands the weights' memory back to the driver in pieces (its
allocations, one per block the caching allocator asked for) and maps them all again in
``wake_up(["weights"])`` before anything may be copied: ~9 ms for a 0.5B model, 26 ms for
a 7B, all of it in front of the copy. Mapped piece by piece instead, just before the
staged copy scatters into it, the mapping runs while earlier pieces cross PCIe.

Pure bookkeeping: no torch, no CUDA (tested on CPU to the byte).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from spswap.errors import TransferError


@dataclass(frozen=True)
class Allocation:
    """One block of device memory the allocator maps as a whole: ``[ptr, ptr + size)``."""

    ptr: int
    size_bytes: int


@dataclass(frozen=True)
class Slice:
    """``size_bytes`` written at byte ``offset`` of the tensor ``name`` (a staged piece's
    scatter: :class:`spswap.transfer.copy.Piece`'s slices)."""

    name: str
    offset: int
    size_bytes: int


def allocations_by_piece(
    pieces: Sequence[Sequence[Slice]], tensor_ptrs: Mapping[str, int],
    allocations: Sequence[Allocation],
) -> list[list[Allocation]]:  # fmt: skip
    """For each piece in copy order, the allocations to map before its scatter: those its
    slices write into that no earlier piece did, in address order. Allocations no piece
    writes (buffers the pool does not hold, padding) go with the last piece, so that all
    are mapped once the copy's last scatter is issued; with no pieces, one list of all.

    A slice that starts outside every allocation needs none mapped (its memory is not the
    sleeping allocator's: a tensor made after the model's load stays where it is).
    Raises TransferError when a slice runs from an allocation into memory that is no
    allocation's (then part of it would be written unmapped), or allocations overlap."""
    ordered = sorted(allocations, key=lambda a: a.ptr)
    for a, b in zip(ordered, ordered[1:], strict=False):
        if a.ptr + a.size_bytes > b.ptr:
            raise TransferError(f"allocations overlap at {b.ptr:#x}: not one allocator's")
    starts = [a.ptr for a in ordered]
    taken: set[int] = set()
    out: list[list[Allocation]] = []
    for piece in pieces:
        need: list[Allocation] = []
        for s in piece:
            if s.size_bytes <= 0:
                continue
            lo = tensor_ptrs[s.name] + s.offset
            hi = lo + s.size_bytes
            i = bisect.bisect_right(starts, lo) - 1
            if i < 0 or lo >= ordered[i].ptr + ordered[i].size_bytes:
                continue  # not in the sleeping memory
            while lo < hi:  # a tensor may span allocations laid out back to back
                cur = ordered[i] if 0 <= i < len(ordered) else None
                if cur is None or not cur.ptr <= lo < cur.ptr + cur.size_bytes:
                    raise TransferError(f"{s.name} runs on at {lo:#x}, past the sleeping "
                                        "allocations it starts in")  # fmt: skip
                if cur.ptr not in taken:
                    taken.add(cur.ptr)
                    need.append(cur)
                lo = cur.ptr + cur.size_bytes
                i += 1
        out.append(sorted(need, key=lambda a: a.ptr))
    rest = [a for a in ordered if a.ptr not in taken]
    if out:
        out[-1] = sorted(out[-1] + rest, key=lambda a: a.ptr)
    else:
        out.append(rest)
    return out
