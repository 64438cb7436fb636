"""Placement of requests on GPUs: buddy pairs, best fit, whole GPUs."""

from __future__ import annotations

import pytest

from spswap.slots.alloc import allocate


def test_four_quarters_fill_one_gpu_before_the_next() -> None:
    held: dict[int, set[int]] = {}
    for expected in (0, 1, 2, 3):
        gpus, units = allocate(held, [0, 1], units=1)  # type: ignore[misc]
        assert gpus == (0,) and units == (expected,)
        held.setdefault(0, set()).add(expected)
    assert allocate(held, [0, 1], units=1) == ((1,), (0,))


def test_two_plus_two_pack() -> None:
    assert allocate({}, [0], units=2) == ((0,), (0, 1))
    assert allocate({0: {0, 1}}, [0], units=2) == ((0,), (2, 3))
    assert allocate({0: {0, 1, 2, 3}}, [0], units=2) is None


def test_one_one_two_pack() -> None:
    # The second quarter goes next to the first, leaving a whole pair for a half.
    assert allocate({0: {0}}, [0], units=1) == ((0,), (1,))
    assert allocate({0: {0, 1}}, [0], units=2) == ((0,), (2, 3))


def test_half_needs_an_aligned_free_pair() -> None:
    # Units 1 and 2 free but not a buddy pair: a half does not fit.
    assert allocate({0: {0, 3}}, [0], units=2) is None
    assert allocate({0: {0, 3}}, [0], units=1) == ((0,), (1,))


def test_small_requests_go_to_the_fullest_gpu() -> None:
    held = {0: set(), 1: {0, 1}}
    assert allocate(held, [0, 1], units=2) == ((1,), (2, 3))
    assert allocate(held, [0, 1], units=1) == ((1,), (2,))
    assert allocate(held, [0, 1], units=4) == ((0,), (0, 1, 2, 3))


def test_candidates_limit_the_choice() -> None:
    assert allocate({0: {0}}, [0], units=4) is None
    assert allocate({0: {0}}, [1], units=4) == ((1,), (0, 1, 2, 3))


@pytest.mark.parametrize(
    ("held", "n", "expected"),
    [
        ({}, 2, (0, 1)),
        ({0: {3}}, 2, (1, 2)),
        ({0: {3}, 2: {0}}, 2, None),
        ({1: {1}}, 1, (0,)),
    ],
)
def test_whole_gpus(held: dict[int, set[int]], n: int, expected: tuple[int, ...] | None) -> None:
    got = allocate(held, [0, 1, 2], units=4, whole_gpus=n)
    assert got == (None if expected is None else (expected, (0, 1, 2, 3)))


def test_bad_unit_count_is_rejected() -> None:
    with pytest.raises(ValueError, match="1, 2, 4"):
        allocate({}, [0], units=3)
