"""The order a sleeping engine's weight memory is mapped in for the overlapped wake
(spswap.transfer.map_order): pure, on CPU."""

from __future__ import annotations

import pytest

from spswap.errors import TransferError
from spswap.transfer.map_order import Allocation, Slice, allocations_by_piece

A = Allocation(0x1000, 0x1000)  # [0x1000, 0x2000)
B = Allocation(0x2000, 0x1000)  # right after A
C = Allocation(0x8000, 0x800)
D = Allocation(0x9000, 0x100)  # no piece writes it


def test_each_allocation_is_mapped_before_the_first_piece_that_writes_it_and_once() -> None:
    ptrs = {"emb": 0x1000, "w1": 0x8000, "w2": 0x1800}
    pieces = [
        [Slice("w1", 0, 0x400)],  # C
        [Slice("w1", 0x400, 0x400), Slice("emb", 0, 0x100)],  # C again (already), A
        [Slice("w2", 0, 0x900)],  # [0x1800, 0x2100): the end of A, then B
    ]
    got = allocations_by_piece(pieces, ptrs, [D, C, B, A])
    assert got == [[C], [A], [B, D]]


def test_the_rest_goes_with_the_last_piece_and_no_pieces_map_everything() -> None:
    assert allocations_by_piece([[Slice("x", 0, 8)]], {"x": 0x8000}, [A, C]) == [[A, C]]
    assert allocations_by_piece([], {}, [C, A]) == [[A, C]]
    assert allocations_by_piece([[Slice("x", 0, 0)]], {"x": 0x5}, [A]) == [[A]]


def test_a_slice_outside_the_sleeping_memory_needs_nothing_mapped() -> None:
    # before every allocation, in the gap after B: memory that never slept
    pieces = [[Slice("x", 0, 0x10)], [Slice("y", 0, 0x10), Slice("z", 0, 0x10)]]
    got = allocations_by_piece(pieces, {"x": 0x0800, "y": 0x3000, "z": 0x8010}, [A, B, C])
    assert got == [[], [A, B, C]]


@pytest.mark.parametrize(
    ("ptr", "size", "where"), [(0x1F00, 0x1200, "0x3000"), (0x8700, 0x200, "0x8800")]
)
def test_a_slice_running_out_of_the_sleeping_memory_is_refused(
    ptr: int, size: int, where: str
) -> None:
    # starts in A and runs through B into the gap; starts in C and runs past its end
    with pytest.raises(TransferError, match=f"x runs on at {where}, past the sleeping"):
        allocations_by_piece([[Slice("x", 0, size)]], {"x": ptr}, [A, B, C])


def test_overlapping_allocations_are_refused() -> None:
    with pytest.raises(TransferError, match="allocations overlap at 0x1800"):
        allocations_by_piece([], {}, [A, Allocation(0x1800, 0x100)])
