"""A job's checkpoint record in spswapd: the identity a dump is taken under, the status
(``run/checkpoints/<job>.json``, :mod:`spswap.daemon.statuses`) as the
``checkpoint.status`` op shows it, and what the dump and restore ops share.

The checkpoint ops, for one job's instance P and, after the requeue, the new run's proxy Q:

- P (asleep, slot released) asks ``checkpoint`` (:mod:`spswap.daemon.ckpt_dump`). The
  daemon answers at once and dumps P in a thread once P has closed the connection (a
  connected socket cannot be dumped). On success P is gone and its image is on tmpfs,
  or, when P was parked outside its job and fits the keep budget, P is kept: alive beside
  its image, frozen in its parked cgroup (:mod:`spswap.daemon.kept`). On failure P runs
  on and gets SIGUSR2.
- Q (new run, restart count > 0, slot reserved) asks ``restore``
  (:mod:`spswap.daemon.ckpt_restore`). The daemon wakes the kept P (identity check, thaw,
  CUDA restore and unlock), or checks the image's identity and integrity and restores P
  (CUDA restore and unlock included); it moves P into Q's cgroups, records the new run for
  P and sends P SIGUSR2; P asks ``checkpoint.status`` and carries on.
- A rejected image (other identity, changed bytes) is deleted and Q cold-starts; the
  reason goes to the event log, the answer and ``spswap status``.

Images hold pool uses (:mod:`spswap.daemon.image_uses`); a daemon that starts cleans up
after a dead one (:mod:`spswap.daemon.ckpt_recover`).

The identity parts the caller cannot be trusted with (uid, driver, GPU model, CRIU) are
taken by the daemon itself; the caller names its engine, versions, model and config.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Any

from spswap.checkpoint.gpu_map import job_gpu_uuids, uuids_by_minor
from spswap.checkpoint.images import Identity, node_identity
from spswap.daemon.jobs import JobState
from spswap.daemon.missed_prolog import register_missed_run
from spswap.daemon.protocol import Answer
from spswap.daemon.statuses import CheckpointState
from spswap.errors import BadRequest, CheckpointFailed
from spswap.liveness import pid_alive

if TYPE_CHECKING:
    from spswap.daemon.jobs import JobRecord
    from spswap.daemon.state import Context, DaemonState


IDENTITY_ARGS = ("engine", "engine_version", "torch", "python", "model_digest", "config_hash")
RESUME_SIGNAL = signal.SIGUSR2


def identity_of(args: dict[str, Any], uid: int) -> Identity:
    """The identity a dump is taken and checked under: what the caller names
    (:data:`IDENTITY_ARGS`), with the uid of the job and this node's own parts."""
    missing = [a for a in IDENTITY_ARGS if not args.get(a)]
    if missing:
        raise BadRequest(f"checkpoint identity incomplete: give {', '.join(missing)}")
    return Identity(uid=uid, **{a: str(args[a]) for a in IDENTITY_ARGS}, **node_identity())


def running_job(ctx: Context, job_id: str) -> JobRecord:
    """The job's record (see :meth:`Context.job_for`) when its current run runs here: registered
    by its prolog or, where slurmd ran none, now (:mod:`spswap.daemon.missed_prolog`);
    refused otherwise: checkpoints and restores are for the job's running instance."""
    rec = register_missed_run(ctx.state, ctx.job_for(job_id))
    if rec.state is not JobState.RUNNING:
        raise CheckpointFailed(
            f"job {rec.job_id} is {rec.state} on this node, and Slurm does not say a new run "
            "of it runs here: checkpoints and restores are for the job's running instance "
            "(its prolog registers each run)"
        )
    return rec


def resume(pid: int, pid_start: int | None) -> None:
    """Tell a parked instance to look at its status (it runs on: the dump failed). Only
    the very process that parked: SIGUSR2 would end another that took over its pid."""
    if not pid_alive(pid, pid_start):
        return
    try:
        os.kill(pid, RESUME_SIGNAL)
    except ProcessLookupError:
        pass


def run_gpu_uuids(st: DaemonState, job_id: str) -> list[str]:
    """The UUIDs of the GPUs the prolog recorded for the job's current run (none without
    a driver): what a restore on other GPUs is remapped against."""
    rec = st.jobs.get(job_id)
    by_minor = uuids_by_minor()
    if rec is None or not rec.gpus or not by_minor:
        return []
    try:
        return job_gpu_uuids(rec.gpus, by_minor)
    except CheckpointFailed as e:  # no remap then: a same-GPU restore still works
        st.event("checkpoint.gpus_unknown", job_id=job_id, reason=str(e))
        return []


def no_image_reason(job_id: str, status: dict[str, Any]) -> str:
    """Why a job's run cannot be restored, from its checkpoint status (shown to the user)."""
    state = status.get("state", "none")
    if state == "none":
        return f"job {job_id} has no checkpoint image (never dumped on this node): cold start"
    if state == CheckpointState.RESTORED:
        return (f"job {job_id}'s image was restored already (it is single use) and that "
                "instance has ended: cold start")  # fmt: skip
    if state == CheckpointState.DUMPING:
        return f"job {job_id}'s dump has not finished: cold start"
    what = {
        CheckpointState.FAILED: "its dump failed",
        CheckpointState.REJECTED: "its image was refused",
        CheckpointState.DELETED: "its image was deleted",
    }
    why = status.get("reason")
    said = what.get(state, f"its checkpoint is {state}")
    return f"job {job_id} has no saved image: {said}" + (f" ({why})" if why else "") + \
        ": cold start"  # fmt: skip


def op_checkpoint_status(ctx: Context, args: dict[str, Any]) -> Answer:
    """Where the job's checkpoint stands: dumping, saved, failed, rejected or restored."""
    job_id = args["job_id"]
    ctx.job_for(job_id)
    return ctx.state.statuses.read(job_id) or {"job_id": job_id, "state": CheckpointState.NONE}
