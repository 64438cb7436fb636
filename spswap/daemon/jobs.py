"""The daemon's record of the Slurm jobs on this node (``run/jobs/<job_id>.json``).

Kept on tmpfs, not in the daemon's memory, so a restarted daemon knows every job the
prolog registered. The epilog marks a record ended (and requeued, when Slurm will run
the job again); ended records are pruned after :data:`ENDED_KEEP_S`.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from spswap.errors import BadRequest
from spswap.fsutil import STATE_VERSION, atomic_write_json, read_json

ENDED_KEEP_S = 24 * 3600.0
_JOB_ID = re.compile(r"^[A-Za-z0-9_.+-]{1,64}$")


class JobState(str, Enum):
    """A job on this node, as its hooks told the daemon."""

    RUNNING = "running"  # the prolog registered it
    REQUEUED = "requeued"  # the epilog ran, and Slurm runs it again
    ENDED = "ended"  # the epilog ran (pruned after ENDED_KEEP_S)

    def __str__(self) -> str:  # messages show "ended", on every Python
        return self.value


@dataclass
class JobRecord:
    """One job as the prolog saw it."""

    job_id: str
    uid: int
    user: str = ""
    gpus: list[int] = field(default_factory=list)
    restart_count: int = 0
    registered_at: float = 0.0
    state: JobState = JobState.RUNNING
    ended_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"v": STATE_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobRecord:
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        if "state" in fields:
            fields["state"] = JobState(fields["state"])
        return cls(**fields)


def check_job_id(job_id: str) -> str:
    """Job ids become file names: only ``[A-Za-z0-9_.+-]`` (Slurm's ids and array ids)."""
    if not _JOB_ID.match(job_id) or job_id in (".", ".."):
        raise BadRequest(f"job id {job_id!r} is not a Slurm job id (digits, e.g. 1234 or 1234_5)")
    return job_id


class JobStore:
    """Job records in one directory."""

    def __init__(self, jobs_dir: Path) -> None:
        self.dir = jobs_dir

    def path(self, job_id: str) -> Path:
        return self.dir / f"{check_job_id(job_id)}.json"

    def get(self, job_id: str) -> JobRecord | None:
        data = read_json(self.path(job_id))
        return None if data is None else JobRecord.from_json(data)

    def put(self, record: JobRecord) -> None:
        atomic_write_json(self.path(record.job_id), record.to_json(), mode=0o644)

    def all(self) -> list[JobRecord]:
        out = []
        for p in sorted(self.dir.glob("*.json")):
            try:
                data = read_json(p)
            except Exception:  # a broken record must not hide the others
                continue
            if isinstance(data, dict):
                out.append(JobRecord.from_json(data))
        return out

    def prune(self, now: float | None = None, keep_s: float = ENDED_KEEP_S) -> list[str]:
        """Remove ended records older than ``keep_s``; the job ids removed."""
        now = time.time() if now is None else now
        gone = []
        for rec in self.all():
            if (
                rec.state is JobState.ENDED
                and rec.ended_at is not None
                and now - rec.ended_at > keep_s
            ):
                try:
                    os.unlink(self.path(rec.job_id))
                    gone.append(rec.job_id)
                except FileNotFoundError:
                    pass
        return gone
