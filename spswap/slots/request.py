"""What a reservation may ask for, and what a caller is told when it cannot be met.

Pure functions over the table's GPU list and state: the checks that turn arguments into
a :class:`~spswap.slots.state.SlotRequest` (each error lists what is valid) and the
text of a :class:`~spswap.errors.SlotTimeout` (who holds the GPUs, who waits ahead).
"""

from __future__ import annotations

from collections.abc import Sequence

from spswap.errors import SlotError, SlotTimeout
from spswap.slots.alloc import UNITS_PER_GPU, VALID_UNITS
from spswap.slots.state import Reservation, SlotRequest, Waiter


def make_request(
    gpus: Sequence[int], units: int, whole_gpus: int | None, allowed_gpus: Sequence[int] | None
) -> SlotRequest:
    """The request for ``units`` of one GPU, or ``whole_gpus`` whole GPUs, among
    ``allowed_gpus`` (default: every one of ``gpus``); :class:`SlotError` says why not."""
    if not gpus:
        raise SlotError(
            "no GPUs known on this node: NVML found none and there is no /dev/nvidia<N>; set "
            "SPSWAP_GPUS in /etc/default/spswap (e.g. SPSWAP_GPUS=0,1,2,3)"
        )
    valid_gpus = ", ".join(map(str, gpus))
    if allowed_gpus is None:
        candidates = tuple(gpus)
    else:
        candidates = tuple(sorted(set(int(g) for g in allowed_gpus)))
        unknown = [g for g in candidates if g not in gpus]
        if unknown or not candidates:
            raise SlotError(
                f"GPU(s) {unknown or '(none)'} are not on this node; valid GPUs: {valid_gpus}"
            )
    if whole_gpus is not None:
        if units != UNITS_PER_GPU:
            raise SlotError(f"give either units ({units}) or whole_gpus ({whole_gpus}), not both")
        if not 1 <= whole_gpus <= len(candidates):
            raise SlotError(
                f"whole_gpus must be 1..{len(candidates)} "
                f"(GPUs {', '.join(map(str, candidates))}), got {whole_gpus}"
            )
        return SlotRequest(UNITS_PER_GPU, whole_gpus, candidates)
    if units not in VALID_UNITS:
        raise SlotError(
            f"units must be one of {', '.join(map(str, VALID_UNITS))} (a quarter, half or "
            f"whole GPU), got {units}; for more than one GPU use whole_gpus (--gpus N)"
        )
    return SlotRequest(units, None, candidates)


def timeout_error(
    req: SlotRequest, model: str, timeout_s: float, blockers: Sequence[Reservation],
    ahead: Sequence[Waiter],
) -> SlotTimeout:  # fmt: skip
    """The error for a wait that ran out: who holds the GPUs, who waited ahead, what to do."""
    holders = [r.describe() for r in blockers]
    lines = [f"no slot for model {model} ({req.describe()}) after {timeout_s:g} s."]
    if holders:
        lines.append("held by:")
        lines += [f"  {h}" for h in holders]
    if ahead:
        queued = ", ".join(
            f"ticket {w.ticket} (model {w.model}, pid {w.holder.pid})" for w in ahead
        )
        lines.append(f"{len(ahead)} earlier waiter(s) for these GPUs: {queued}")
    lines.append(
        "wait longer (`spswap serve --slot-timeout-s`, `spswap slots reserve --timeout-s`) "
        "or release a reservation no process of yours needs any more (`spswap slots release "
        "ID`; a running server's is its own)"
    )
    return SlotTimeout("\n".join(lines), holders=holders)
