"""Where a request fits on a set of GPUs: a pure function, no files, no locks.

Units within a GPU are buddies: a 2-unit request takes units (0,1) or (2,3), a 4-unit
request the whole GPU. Placement is best fit: the fullest GPU that still has room, and
within it a unit whose buddy is already taken, so small requests fill gaps instead of
breaking up free GPUs and pairs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set

UNITS_PER_GPU = 4
VALID_UNITS = (1, 2, 4)
_PAIRS = ((0, 1), (2, 3))


def allocate(
    held: Mapping[int, Set[int]],
    candidates: Sequence[int],
    *,
    units: int,
    whole_gpus: int | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(gpus, units)`` for the request, or None when it does not fit now.

    ``held`` maps a GPU to the unit indexes taken on it (missing: all free).
    """

    def free_count(g: int) -> int:
        return UNITS_PER_GPU - len(held.get(g, ()))

    if whole_gpus is not None:
        free = [g for g in sorted(candidates) if free_count(g) == UNITS_PER_GPU]
        if len(free) < whole_gpus:
            return None
        return tuple(free[:whole_gpus]), tuple(range(UNITS_PER_GPU))
    options: list[tuple[tuple[int, ...], int, tuple[int, ...]]] = []
    for g in candidates:
        taken = held.get(g, set())
        if units == UNITS_PER_GPU:
            if not taken:
                options.append(((0, g), g, tuple(range(UNITS_PER_GPU))))
        elif units == 2:
            for pair in _PAIRS:
                if not taken & set(pair):
                    other_free = all(u not in taken for p in _PAIRS if p != pair for u in p)
                    options.append(((free_count(g), other_free, g, pair[0]), g, pair))
        elif units == 1:
            for u in range(UNITS_PER_GPU):
                if u not in taken:
                    buddy_free = (u ^ 1) not in taken
                    options.append(((buddy_free, free_count(g), g, u), g, (u,)))
        else:
            raise ValueError(f"units must be one of {VALID_UNITS}, got {units}")
    if not options:
        return None
    _score, gpu, chosen = min(options)
    return (gpu,), chosen
