"""Who holds something, and whether that holder is still alive.

A holder is a process (pid + its start time, so a reused pid is not mistaken for the
old one) and optionally a Slurm job. Bookkeeping asks :func:`holder_alive`; the Slurm
side plugs a job probe in (``job_alive``) without this module importing Slurm.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from spswap.users import user_label

JobProbe = Callable[[str], bool | None]
"""Answers whether a Slurm job is still running; None when it cannot tell."""


def pid_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        # fields[0] is field 3 (state), so field 22 is fields[19]; a zombie is not alive
        if fields[0] == "Z":
            return None
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int, start_time: int | None = None) -> bool:
    """True when ``pid`` runs and, if given, started at ``start_time``."""
    if pid <= 0:
        return False
    current = pid_start_time(pid)
    if current is None:
        return False
    return start_time is None or current == start_time


@dataclass(frozen=True)
class Holder:
    """A process, and optionally a Slurm job, that holds a reservation or uses an entry."""

    pid: int
    pid_start: int | None
    uid: int
    job_id: str | None = None
    since: float = 0.0
    # why spswapd itself holds it: "image" (an image on disk or a dump in progress maps
    # the entry), and for which job (``for_job``: shown, never used to judge liveness);
    # None for any other holder
    purpose: str | None = None
    for_job: str | None = None

    @classmethod
    def current(cls, *, job_id: str | None = None, pid: int | None = None) -> Holder:
        """The calling process (or ``pid``), tied to ``job_id`` or ``$SLURM_JOB_ID``."""
        pid = os.getpid() if pid is None else pid
        if job_id is None:
            job_id = os.environ.get("SLURM_JOB_ID") or None
        return cls(
            pid=pid, pid_start=pid_start_time(pid), uid=os.getuid(), job_id=job_id,
            since=time.time(),
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("purpose", "for_job"):  # (every other holder's files stay as they were)
            if out[name] is None:
                del out[name]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Holder:
        return cls(
            pid=int(data["pid"]), pid_start=data.get("pid_start"), uid=int(data["uid"]),
            job_id=data.get("job_id"), since=float(data.get("since", 0.0)),
            purpose=data.get("purpose"), for_job=data.get("for_job"),
        )  # fmt: skip

    def describe(self) -> str:
        if self.purpose == "image":
            whose = f"job {self.for_job}'s" if self.for_job else "a job's"
            return (f"spswapd, for {whose} checkpoint image (until that job runs again, or "
                    "ends)")  # fmt: skip
        if self.job_id:  # the job keeps it (the process that asked may have exited)
            return f"job {self.job_id} of {user_label(self.uid)}, asked by pid {self.pid}"
        return f"pid {self.pid} of {user_label(self.uid)}"

    def brief(self) -> str:
        """:meth:`describe` in a few words, for a table cell (:data:`IMAGE_USE_NOTE` says
        what an image's use is)."""
        if self.purpose == "image":
            return f"job {self.for_job}'s image" if self.for_job else "a job's image"
        if self.job_id:
            return f"job {self.job_id} ({user_label(self.uid)})"
        return f"pid {self.pid} ({user_label(self.uid)})"


IMAGE_USE_NOTE = ("a job's image: spswapd keeps the entry for that job's checkpoint image, "
                  "until the job runs again or ends")  # fmt: skip


def holder_alive(holder: Holder, job_alive: JobProbe | None = None) -> bool:
    """A live process keeps what it holds; so does the live Slurm job it is bound to.

    The process is looked at first (cheap, /proc); the job only when the process is gone
    (a CLI reservation's process exits at once, its job lives on). When the job probe
    cannot tell (Slurm unreachable), the holder counts as gone only if its process is:
    a controller outage never reclaims a live process's reservation.
    """
    if pid_alive(holder.pid, holder.pid_start):
        return True
    if holder.job_id and job_alive is not None:
        return bool(job_alive(holder.job_id))
    return False
