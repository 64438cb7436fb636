"""``spswap serve``'s word with Slurm about its job: the requeue warning at the start and
the requeue asked at a preemption's end."""

from __future__ import annotations

from spswap.cli.common import err_console
from spswap.errors import SpswapError
from spswap.slurm.backend import get_backend
from spswap.slurm.requeue import requeue_warning


def warn_if_not_requeueable(job_id: str) -> None:
    """Say at the start, in the job log, that a preemption would end this job for good."""
    backend = get_backend(timeout_s=3.0)
    try:
        warning = requeue_warning(backend.job(job_id) if backend is not None else None)
    except SpswapError:
        return  # Slurm could not say: the run goes on, as it would have
    if warning:
        err_console.print(warning, markup=False, soft_wrap=True)


def requeue(job_id: str) -> None:
    """Ask Slurm to requeue ``job_id`` (a refusal is said, not raised)."""
    backend = get_backend()
    if backend is None:
        err_console.print("spswap serve: no Slurm commands here; not requeueing", markup=False)
        return
    try:
        backend.requeue(job_id)
    except SpswapError as e:
        # Preemption requeues the job by itself; a refused second request changes nothing.
        err_console.print(f"spswap serve: requeue request refused ({e})", markup=False)
