"""Whether a job can come back after preemption, told at its start (issue 15 item 8).

``spswap serve`` saves its state for the job's next run; a job Slurm may not requeue has
none: at preemption (``PreemptMode=REQUEUE``) Slurm ends it instead, and the run's
"requeue request refused" came only then. Pure: the caller asks Slurm for the job.
"""

from __future__ import annotations

from spswap.slurm.parse import JobInfo


def requeue_warning(job: JobInfo | None) -> str | None:
    """The job log's warning when Slurm says ``job`` is not requeueable; None when it is,
    or when Slurm could not say (no warning is better than a wrong one)."""
    if job is None or job.requeue is not False:
        return None
    return (
        f"spswap serve: warning: job {job.job_id} is not requeueable (Slurm shows "
        "Requeue=0: it was submitted with --no-requeue, or without --requeue where "
        "slurm.conf sets JobRequeue=0). At preemption Slurm ends it instead of requeueing "
        "it: spswap serve then saves nothing (no next run would use it) and the job's work "
        "is lost. Submit it with `sbatch --requeue` (#SBATCH --requeue, as the templates "
        "do)."
    )


# scontrol's words when it refuses to requeue a job whose Requeue flag is 0
_REQUEUE_DISABLED = "Requested operation is presently disabled"


def requeue_refusal(job_id: str, output: str) -> str | None:
    """What ``scontrol requeue``'s refusal means when it refused a job Slurm may not
    requeue (its ``output`` says the operation is disabled); None for other refusals.

    >>> requeue_refusal("7", "slurm_requeue error: Invalid job id specified") is None
    True
    """
    if _REQUEUE_DISABLED not in output:
        return None
    return (
        f"Slurm may not requeue job {job_id} (it answers {_REQUEUE_DISABLED!r}: the job "
        "shows Requeue=0, submitted with --no-requeue or without --requeue where "
        "slurm.conf sets JobRequeue=0); submit it with `sbatch --requeue`"
    )


def requeued_note(job_id: str, restart_count: int) -> str | None:
    """The job log's line at the start of a requeued run: Slurm wrote "CANCELLED ... DUE TO
    JOB REQUEUE" into the log just before, which reads like a failure; None for run 0.

    >>> requeued_note("88", 0) is None
    True
    """
    if restart_count <= 0:
        return None
    return (
        f"spswap serve: job {job_id} run {restart_count}: Slurm requeued the job (its "
        "'CANCELLED ... DUE TO JOB REQUEUE' line above is the requeue, not a failure)"
    )
