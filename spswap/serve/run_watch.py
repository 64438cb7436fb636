"""The run's own process under Slurm: the process the batch script waits on is never the
instance that spswapd parks.

spswapd takes a stopped instance out of its job's cgroup before CRIU dumps it and, when it
fits the keep budget, keeps it alive there (frozen) for the job's next run. A process kept
alive never exits: a batch script waiting on it, and Slurm on the batch script, would
wait for KillWait's SIGKILL (5 s here, 30 s by default) before the job ends and the next
job gets the GPU; on the H200 that was 5 s of every 8 s turn. So inside a job's cgroup
``spswap serve`` forks: the child is the instance (it serves, parks, and may come back in
a later run), the parent, the batch script's child, forwards the stop signals to it and
ends the run as soon as the instance has left the job (spswapd says so) or exited. A
requeued run's stand-in for its restored instance (:func:`stand_in_for`) ends the same way.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from spswap.checkpoint.cgroups import (
    PREFIX,
    PROC,
    mounts,
    own_dirs,
    parse_proc_cgroup,
    procs_of,
)
from spswap.serve.run_log import process_started_s

StatusOf = Callable[[str], dict[str, Any]]
POLL_S = 0.05
FORWARDED = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


def in_job_cgroup(proc_cgroup_text: str, job_id: str) -> bool:
    """Whether ``/proc/<pid>/cgroup`` text puts the process in Slurm job ``job_id``'s cgroup
    (``.../job_<id>/step_batch/...``, cgroup v2 or v1): where spswapd would park it."""
    component = f"job_{job_id}"
    return any(component in m.path.split("/") for m in parse_proc_cgroup(proc_cgroup_text))


def parked_away(proc_cgroup_text: str) -> bool:
    """Whether the process sits in one of spswapd's parked cgroups (``spswap-parked-*``)."""
    return any(m.path.rsplit("/", 1)[-1].startswith(PREFIX)
               for m in parse_proc_cgroup(proc_cgroup_text))  # fmt: skip


def _cgroup_text(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return ""


def left_job(pid: int, job_id: str, status_of: StatusOf) -> bool:
    """Whether instance ``pid`` has left job ``job_id`` for good: parked outside the job,
    with spswapd's word (``left_job`` in the job's checkpoint status) that nothing of the
    job's end waits on it any more (the requeue it asked for is made). Reading the cgroup
    first keeps the daemon out of the poll until a park is under way."""
    if not parked_away(_cgroup_text(pid)):
        return False
    try:
        status = status_of(job_id)
    except Exception:  # noqa: BLE001 - spswapd busy or away: ask again on the next poll
        return False
    return bool(status.get("left_job")) and status.get("pid") == pid


def job_dir(own: Path, job_id: str) -> Path | None:
    """The job's cgroup directory above ``own`` (a process's cgroup directory inside it:
    ``.../job_<id>/step_batch/...``), None when ``own`` is not inside job ``job_id``."""
    parts = own.parts
    component = f"job_{job_id}"
    return Path(*parts[: parts.index(component) + 1]) if component in parts else None


def left_in_job(job_id: str, keep: set[int], proc: Path = PROC) -> list[tuple[int, str]]:
    """The processes still in job ``job_id``'s cgroup (the hierarchies Slurm tracks a
    job by), but ``keep`` and Slurm's own slurmstepd, as (pid, command name). Slurm ends a
    job only once its cgroup is empty: it SIGKILLs what is left and looks again in steps
    of a second (tests/slurm/test_slurm_job_end.py), so anything here when the run ends
    dies and may cost that second."""
    pids: set[int] = set()
    for own in own_dirs(mounts(proc), proc).values():
        top = job_dir(own, job_id)
        if top is not None:
            pids |= set().union(*(procs_of(d) for d in [top, *top.rglob("*")] if d.is_dir()))
    left = []
    for pid in sorted(pids - keep):
        try:
            comm = (proc / str(pid) / "comm").read_text().strip()
        except OSError:
            continue  # gone meanwhile
        if comm != "slurmstepd":
            left.append((pid, comm))
    return left


def say_left_in_job(job_id: str) -> None:
    """One line in the job log when the run ends with something of the job left in its
    cgroup (the run itself and the batch shell aside). Never raises: a diagnostic."""
    try:
        left = left_in_job(job_id, {os.getpid(), os.getppid()})
    except Exception:  # noqa: BLE001 - the run's end must not fail for a diagnostic
        return
    if left:
        print(left_message(left), file=sys.stderr, flush=True)


def left_message(left: list[tuple[int, str]], shown: int = 8) -> str:
    """The job log's line for what :func:`left_in_job` found. Pure."""
    names = ", ".join(f"pid {pid} ({comm})" for pid, comm in left[:shown])
    more = f" and {len(left) - shown} more" if len(left) > shown else ""
    return (f"spswap serve: the run ends with {len(left)} process(es) of the job still in its "
            f"cgroup: {names}{more}; Slurm ends the job once they are gone")  # fmt: skip


class RunWatch:
    """The parent's side of the fork (see the module doc)."""

    def __init__(self, child_pid: int, job_id: str, status_of: StatusOf) -> None:
        self.child_pid = child_pid
        self.job_id = job_id
        self.status_of = status_of
        self.gone = False  # the instance has left the job: nothing is forwarded any more

    def _forward(self, signum: int, _frame: FrameType | None = None) -> None:
        if not self.gone:
            try:
                os.kill(self.child_pid, signum)
            except ProcessLookupError:
                pass

    def wait(self) -> int:
        """Forward stop signals until the instance exits (its exit code) or leaves the job
        (0: the run is over, the instance waits for the next one)."""
        for sig in FORWARDED:
            signal.signal(sig, self._forward)
        while True:
            pid, status = os.waitpid(self.child_pid, os.WNOHANG)
            if pid == self.child_pid:
                code = os.waitstatus_to_exitcode(status)
                return 128 - code if code < 0 else code  # killed by a signal: 128 + its number
            if left_job(self.child_pid, self.job_id, self.status_of):
                self.gone = True
                say_left_in_job(self.job_id)
                return 0
            time.sleep(POLL_S)


def fork_instance(job_id: str | None, status_of: StatusOf) -> float | None:
    """Inside job ``job_id``'s cgroup: fork; the child returns the run's start (epoch
    seconds, for its ``runs.jsonl`` line) and serves on, the parent watches it
    (:class:`RunWatch`) and exits with what the run ends with. Elsewhere (no job, no job
    cgroup: nothing is ever parked) returns None without forking."""
    if job_id is None or not in_job_cgroup(_cgroup_text(os.getpid()), job_id):
        return None
    started_s = process_started_s()
    sys.stdout.flush()  # or both processes would write what is buffered
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        return started_s
    os._exit(RunWatch(child, job_id, status_of).wait())  # nothing of the child's to flush
