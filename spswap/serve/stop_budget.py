"""How long a stop may drain: what Slurm leaves a run between its SIGTERM and the SIGKILL.

After a stop signal the running requests get ``--drain-s`` to finish; then the engine
sleeps, and spswapd parks and dumps the instance, which must have left the job before
slurm.conf's KillWait ends in SIGKILL (a requeue and a preemption's SIGTERM alike).
A drain as long as KillWait (5 s, the default) lost the request being answered and the
checkpoint with it. So a drain that does not fit is cut, and the job log says so."""

from __future__ import annotations

PARK_MARGIN_S = 2.0  # after the drain: sleep, CUDA checkpoint and park (0.7-0.8 s on the H200)
MIN_DRAIN_S = 0.5


def fitted_drain_s(drain_s: float, kill_wait_s: float | None) -> tuple[float, str | None]:
    """The drain to use, and what to log when it was cut to fit ``kill_wait_s``."""
    if kill_wait_s is None or drain_s + PARK_MARGIN_S <= kill_wait_s:
        return drain_s, None
    fitted = max(MIN_DRAIN_S, kill_wait_s - PARK_MARGIN_S)
    if fitted >= drain_s:
        return drain_s, None
    return fitted, (
        f"spswap serve: the drain at a stop (--drain-s, {drain_s:g} s) cut to {fitted:g} s: "
        "Slurm kills a stopped "
        f"job {kill_wait_s:g} s after its SIGTERM (KillWait), and what it serves must be put "
        f"away before that ({PARK_MARGIN_S:g} s kept for it)"
    )
