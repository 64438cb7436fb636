"""The jobs' checkpoint status files, ``run/checkpoints/<job>.json``: dumping, saved,
failed, rejected, restored or deleted, with the details of each. The daemon writes them;
the instance, ``spswap status`` and the ops read them (so each write is atomic). A leaf:
what the daemon object (:mod:`spswap.daemon.state`) and the kept trees build on."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any

from spswap.fsutil import atomic_write_json, read_json


class CheckpointState(str, Enum):
    """Where a job's checkpoint stands: the ``state`` of its status file."""

    NONE = "none"  # no status (never checkpointed here)
    DUMPING = "dumping"  # the dump runs (the tree may have left its job already)
    SAVED = "saved"  # the image is complete (and the tree kept alive, when ``kept``)
    FAILED = "failed"  # the dump or the restore failed: the next run starts cold
    REJECTED = "rejected"  # the image may not be restored (identity, integrity, owner)
    RESTORED = "restored"  # brought back into a later run
    DELETED = "deleted"  # the image was removed (its job is gone, or the tmpfs full), or
    # the job of a restored instance ended for good: nothing of it is kept here

    def __str__(self) -> str:  # messages show "saved", on every Python
        return self.value


# The states a job's status can end in: spswapd forgets such a status once Slurm no
# longer knows the job (job_ops.collect_images), or `spswap status` lists it for ever
ENDED_STATES = (CheckpointState.DELETED, CheckpointState.FAILED, CheckpointState.REJECTED)


class CheckpointStatuses:
    """The status files of one daemon's jobs, under ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def path(self, job_id: str) -> Path:
        """Where the job's checkpoint status is kept."""
        return self.dir / f"{job_id}.json"

    def read(self, job_id: str) -> dict[str, Any]:
        """The job's status; ``{}`` when it has none."""
        return read_json(self.path(job_id)) or {}

    def write(self, job_id: str, **status: Any) -> None:
        """Replace the job's checkpoint status (atomically: the instance may read it now).
        The job's owner (``uid``) stays from the status before unless given: a job does
        not change hands, and `spswap status` names it on every state (the walk: a
        deleted or failed status lost it)."""
        if "uid" not in status:
            owner = self.read(job_id).get("uid")
            if isinstance(owner, int):
                status["uid"] = owner
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o755)
        atomic_write_json(self.path(job_id), {"job_id": job_id, **status})

    def jobs_in(self, *states: CheckpointState) -> list[str]:
        """The jobs whose status is one of ``states`` now."""
        found = []
        for path in sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []:
            status = read_json(path)
            if isinstance(status, dict) and status.get("state") in states:
                found.append(str(status.get("job_id") or path.stem))
        return found

    def remove(self, job_id: str) -> None:
        """Forget the job's status (its job is past Slurm's memory: nobody can ask)."""
        self.path(job_id).unlink(missing_ok=True)

    def mark_gone(self, job_id: str, reason: str, *, images_deleted: bool) -> None:
        """The job will not run here again: a status that still says it has an image
        (saved, dumping; when its images were deleted) or a restored instance says
        deleted, with ``reason``. Failed and rejected keep theirs (why it started cold)."""
        state = self.read(job_id).get("state")
        holds = (CheckpointState.SAVED, CheckpointState.DUMPING) if images_deleted else ()
        if state == CheckpointState.RESTORED or state in holds:
            self.write(job_id, state=CheckpointState.DELETED, reason=reason)

    def mark_left_job(self, job_id: str, *, requeued: bool = False) -> None:
        """A dumping job's tree has left its job's cgroup: its run may end without it;
        ``requeued``: spswapd requeued the job already (its epilog then knows it comes
        back without asking Slurm, while the image is still being written)."""
        fields = {"left_job": True, **({"requeued": True} if requeued else {})}
        self._amend(job_id, CheckpointState.DUMPING, **fields)

    def unmark_kept(self, job_id: str) -> None:
        """A saved job's status no longer says kept (``spswap status``): its image remains."""
        status = self.read(job_id)
        if status.get("kept"):
            self._amend(job_id, CheckpointState.SAVED, kept=False,
                        **({"on_gpu": False} if status.get("on_gpu") else {}))  # fmt: skip

    def mark_on_gpu(self, job_id: str) -> None:
        """A saved job's kept tree waits with its GPU state on its GPU (SPSWAP_KEEP_ON_GPU)."""
        self._amend(job_id, CheckpointState.SAVED, on_gpu=True)

    def unmark_on_gpu(self, job_id: str) -> None:
        """A saved job's kept tree's GPU state went back to host memory (kept as before)."""
        if self.read(job_id).get("on_gpu"):
            self._amend(job_id, CheckpointState.SAVED, on_gpu=False)

    def _amend(self, job_id: str, only_in: CheckpointState, **fields: Any) -> None:
        """Set ``fields`` in the job's status while it is ``only_in`` (else leave it)."""
        status = self.read(job_id)
        if status.get("state") == only_in:
            rest = {k: v for k, v in status.items() if k != "job_id"}
            self.write(job_id, **{**rest, **fields})
