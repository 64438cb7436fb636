"""Acting on one's own jobs: submit held, release, requeue-and-hold, cancel, partitions.

What ``spswap bench turns`` (a user tool) does to its jobs; the argv are pure functions
with tests on their exact output, the calls go through :class:`CliBackend`'s runner (one
place for timeouts and the errors that name the fix).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from spswap.errors import SlurmCommandError
from spswap.slurm.backend import CliBackend


def sbatch_argv(script: Path, *, chdir: Path, hold: bool = False,
                extra: Sequence[str] = ()) -> list[str]:  # fmt: skip
    """Submit ``script`` from ``chdir``; ``--parsable`` prints the job id alone."""
    return ["sbatch", "--parsable", *(["--hold"] if hold else []), f"--chdir={chdir}",
            *extra, str(script)]  # fmt: skip


def release_argv(job_ids: Sequence[str]) -> list[str]:
    """Let held jobs be scheduled."""
    return ["scontrol", "release", ",".join(job_ids)]


def requeue_hold_argv(job_ids: Sequence[str]) -> list[str]:
    """Stop running jobs and put them back in the queue, held: Slurm signals the batch
    shell (SIGTERM) and the job keeps its id; its restart count goes up by one."""
    return ["scontrol", "requeuehold", ",".join(job_ids)]


def cancel_argv(job_ids: Sequence[str]) -> list[str]:
    return ["scancel", *job_ids]


def partitions_argv() -> list[str]:
    return ["sinfo", "--noheader", "--format=%R"]


def parse_job_id(sbatch_output: str) -> str:
    """The job id from ``sbatch --parsable`` (``ID`` or ``ID;CLUSTER``)."""
    text = sbatch_output.strip().splitlines()[-1] if sbatch_output.strip() else ""
    job_id = text.split(";", 1)[0]
    if not job_id.isdigit():
        raise SlurmCommandError(f"sbatch printed no job id (got {sbatch_output.strip()!r})",
                                argv=["sbatch"], output=sbatch_output)  # fmt: skip
    return job_id


class JobControl(CliBackend):
    """The commands a user runs on their own jobs, with :class:`CliBackend`'s queries."""

    def submit(self, script: Path, *, chdir: Path, hold: bool = False) -> str:
        return parse_job_id(self._run(sbatch_argv(script, chdir=chdir, hold=hold)) or "")

    def release(self, *job_ids: str) -> None:
        self._run(release_argv(job_ids))

    def requeue_hold(self, *job_ids: str) -> None:
        self._run(requeue_hold_argv(job_ids))

    def cancel_all(self, job_ids: Sequence[str]) -> None:
        if job_ids:
            self._run(cancel_argv(job_ids))

    def partitions(self) -> list[str]:
        """Partition names (the default one without sinfo's trailing ``*``)."""
        out = self._run(partitions_argv()) or ""
        return [p.rstrip("*") for p in out.split() if p.strip()]
