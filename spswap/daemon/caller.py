"""The caller of an op as a holder of slots and pool uses: its pid and uid from
``SO_PEERCRED``, bound to a job only when the job is the caller's and runs, and the GPUs
a user's reservation may take."""

from __future__ import annotations

import time
from collections.abc import Sequence

from spswap.daemon.jobs import JobState, check_job_id
from spswap.daemon.missed_prolog import register_missed_run
from spswap.daemon.state import ROOT_UID, Context, DaemonState, authorize
from spswap.errors import PermissionDenied, RequestRefused
from spswap.liveness import Holder, pid_start_time


def peer_holder(ctx: Context, job_id: str | None) -> Holder:
    """The caller as a holder: its pid and uid from SO_PEERCRED, never from the request.

    A job id binds the holder to a Slurm job (it then outlives the process while the job
    runs), so a user may name only a running job the prolog registered for their uid.
    """
    if job_id is not None and ctx.peer_uid != ROOT_UID:
        rec = ctx.state.jobs.get(job_id)
        if rec is None:
            raise PermissionDenied(
                f"job {job_id} is not registered on this node, so it cannot be checked to be "
                f"yours (uid {ctx.peer_uid}); run inside the job (its prolog registers it) "
                "or leave the job id out"
            )
        authorize(ctx.peer_uid, rec.uid, f"job {job_id}")
        rec = register_missed_run(ctx.state, rec)
        if rec.state is not JobState.RUNNING:
            raise PermissionDenied(f"job {job_id} has {rec.state}; a reservation or pool use "
                                   "can be bound only to a running job")  # fmt: skip
    elif job_id is not None:
        check_job_id(job_id)
    start = pid_start_time(ctx.peer_pid)
    if start is None:
        raise RequestRefused(f"the calling process (pid {ctx.peer_pid}) is gone")
    return Holder(pid=ctx.peer_pid, pid_start=start, uid=ctx.peer_uid, job_id=job_id,
                  since=time.time())  # fmt: skip


def job_gpus_only(ctx: Context, job_id: str | None, asked: list[int] | None,
                  node_gpus: Sequence[int]) -> list[int] | None:  # fmt: skip
    """The GPUs a reservation may take: a user's, bound to a job whose prolog recorded its
    GPUs, only those (else a user could queue for every GPU of the node and starve the
    jobs Slurm gave them to); a user's outside such a job, only GPUs that no running job
    of the node holds (``node_gpus`` less theirs); root's, what it asked for."""
    if ctx.peer_uid == ROOT_UID:
        return asked
    rec = ctx.state.jobs.get(job_id) if job_id is not None else None
    if rec is not None and rec.gpus:
        allowed = [g for g in (asked if asked is not None else rec.gpus) if g in rec.gpus]
        if not allowed:
            raise PermissionDenied(f"job {job_id} holds GPUs {rec.gpus}: its reservations "
                                   f"may take only those, not {asked}; leave --gpu out or "
                                   "name one of them")  # fmt: skip
        return allowed
    held = gpus_held_by_jobs(ctx.state)
    if not held:
        return asked
    allowed = [g for g in (asked if asked is not None else node_gpus) if g not in held]
    if not allowed:
        jobs = _held_text(held, sorted(held))
        raise PermissionDenied(
            f"outside a job you may reserve only GPUs that no job of this node holds, and "
            f"{'every one' if asked is None else f'each of {asked}'} is held ({jobs}); run "
            "it inside your job (sbatch or srun), where it takes your job's GPUs"
        )  # fmt: skip
    return allowed


def gpus_held_by_jobs(state: DaemonState) -> dict[int, str]:
    """GPU -> the running job of this node that Slurm gave it to."""
    return {g: j.job_id for j in state.jobs.all() if j.state is JobState.RUNNING
            for g in j.gpus}  # fmt: skip


def _held_text(held: dict[int, str], gpus: Sequence[int]) -> str:
    """``GPU 0: job 12, GPU 1: job 13``: which job holds each of ``gpus``."""
    return ", ".join(f"GPU {g}: job {held[g]}" for g in gpus)


def jobless_barred(state: DaemonState, holder: Holder, allowed: Sequence[int]) -> list[int]:
    """The GPUs of ``allowed`` that a user's reservation outside a job may not take now,
    checked again at each attempt to grant it: a job may have been given one while it
    waited. :class:`PermissionDenied` once every one of them is a job's."""
    held = gpus_held_by_jobs(state)
    barred = [g for g in allowed if g in held]
    if barred and len(barred) == len(allowed):
        jobs = _held_text(held, barred)
        raise PermissionDenied(
            f"while pid {holder.pid} waited for a slot outside a job, Slurm gave "
            f"{'its GPU' if len(barred) == 1 else 'each of its GPUs'} to a job ({jobs}); "
            "run it inside your job (sbatch or srun), where it takes your job's GPUs"
        )  # fmt: skip
    return barred
