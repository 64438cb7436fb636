"""The serving process's side of CRIU checkpoint and restore (the daemon does the work).

``park``: an asleep instance asks the daemon to dump it, closes the connection (a connected
socket cannot be dumped) and waits. If the dump succeeds the process ends there; when a
later run restores it, it wakes up inside this wait, gets SIGUSR2 from the daemon and
learns its new run from ``checkpoint.status``. If the dump fails, SIGUSR2 comes at once and
the status says why: the caller exits as it would without CRIU (its requests are saved).

``restore``: the new run's proxy asks the daemon to bring the job's instance back.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from spswap.checkpoint.proctree import process_tree_pids
from spswap.config import Config
from spswap.daemon.client import Client
from spswap.daemon.lifecycle import ping
from spswap.daemon.statuses import CheckpointState
from spswap.errors import SpswapError
from spswap.liveness import pid_alive, pid_start_time
from spswap.slurm.backend import get_backend
from spswap.slurm.parse import stopped_for_good

RESUME_SIGNAL = signal.SIGUSR2
PARK_SLICE_S = 300.0  # between status checks while parked (never during a dump's freeze)
RESTORE_TIMEOUT_S = 1800.0  # hashing + CRIU + CUDA restore of a large image
RESEND_S = 1.0  # a forwarded stop is sent again this often until the instance exits
# In the run's state directory: "<job id> 0" when Slurm said at the job's first run that
# it may not requeue the job (Requeue=0), "<job id> 1" when it may (`spswap serve`'s
# start writes it: the stop reads it there, asking Slurm nothing on its own path).
REQUEUE_FILE = "requeue"


def requeue_file_text(job_id: str, requeue: bool) -> str:
    """:data:`REQUEUE_FILE`'s text.

    >>> requeue_file_text("88", False)
    '88 0\\n'
    """
    return f"{job_id} {int(requeue)}\n"


def requeueable(state_dir: Path, job_id: str | None) -> bool | None:
    """What job ``job_id``'s first run learnt of Slurm's Requeue flag
    (:data:`REQUEUE_FILE`); None when it could not ask, or the file is another job's (a
    state directory given twice)."""
    try:
        words = (state_dir / REQUEUE_FILE).read_text().split()
    except OSError:
        return None
    if job_id is None or len(words) != 2 or words[0] != job_id:
        return None
    return {"0": False, "1": True}.get(words[1])


@dataclass
class ParkOutcome:
    """How a park ended: ``restored`` (in a new run) or ``failed`` (dump refused)."""

    state: CheckpointState  # RESTORED or FAILED
    reason: str | None = None
    restart_count: int = 0
    proxy_pid: int | None = None
    timings_s: dict[str, float] | None = None
    kept: bool = False  # woken where it was kept alive, not restored by CRIU


def not_coming_back(job_id: str, stop_signal: str | None, restart_count: int, *,
                    timeout_s: float = 5.0, requeue_flag: bool | None = None,
                    log: Callable[[str], None] | None = None) -> str | None:  # fmt: skip
    """Why a checkpoint at this stop would be wasted (also told to ``log``), or None
    (dump). Preemption's USR1 dumps unless ``requeue_flag`` is False (Slurm said at the
    job's start that it may not requeue it: it ends the job at preemption instead); a
    SIGTERM (scancel, the time limit, a requeue) asks Slurm, and only a job it calls
    ended for good (CANCELLED, TIMEOUT, ...) is not dumped; a Slurm that cannot be asked
    means dump."""
    if stop_signal == "SIGUSR1":
        if requeue_flag is not False:
            return None
        why = (
            f"job {job_id} is not requeueable (Slurm showed Requeue=0 at its start): "
            "Slurm ends it at this preemption instead of requeueing it, so what a "
            "checkpoint saved would never be used; submit it with `sbatch --requeue`"
        )
        if log is not None:
            log(f"spswap serve: not checkpointed: {why}")
        return why

    try:
        backend = get_backend(timeout_s=timeout_s)
        info = backend.job(job_id) if backend is not None else None
    except SpswapError:
        return None
    if info is None or not stopped_for_good(info.state, info.restart_count, restart_count):
        return None
    why = (f"job {job_id} is {info.state} and not requeued (scancel, or its end): it will "
           "not run again")  # fmt: skip
    if log is not None:
        log(f"spswap serve: not checkpointed: {why}")
    return why


def restored_how(kept: bool) -> str:
    """How an instance came back, for the logs of both runs."""
    return "from its kept instance (no CRIU restore)" if kept else "from its image"


class DaemonCheckpointer:
    """Checkpoint through ``spswapd``; one per serving process."""

    def __init__(self, cfg: Config, *, wait_s: float = 3600.0) -> None:
        self.cfg = cfg
        self.wait_s = wait_s
        self.resumed = threading.Event()
        # when the run's process started, where this instance was forked from it
        # (spswap.serve.run_watch); None: this process is the run's
        self.run_started_s: float | None = None

    def install(self) -> None:
        """SIGUSR2 = the daemon says "look at your checkpoint status"."""
        signal.signal(RESUME_SIGNAL, self._on_resume)

    def _on_resume(self, _signum: int, _frame: FrameType | None = None) -> None:
        self.resumed.set()

    def available(self) -> bool:
        return ping(self.cfg)

    def _client(self) -> Any:
        return Client(self.cfg)

    def park(self, job_id: str, identity: dict[str, str], *, requeue: bool = False
             ) -> ParkOutcome:  # fmt: skip
        """Ask to be dumped and wait; returns only if restored later or if the dump failed.

        ``requeue``: the daemon requeues the job once the image is complete (not before:
        a requeue ends the job's processes after KillWait, which could cut a dump short).
        """
        self.resumed.clear()
        self._client().call("checkpoint", job_id=job_id, requeue=requeue, **identity)
        # Frozen and dumped somewhere in this wait (or told the dump failed). Wait in
        # slices and ask the daemon between them: a deadline measured before a dump has
        # long passed after a restore, and only the daemon knows which it was. "saved"
        # seen from in here means a restore is under way (this process runs again only
        # restored, or thawed when it was kept): SIGUSR2 follows once it is "restored".
        status: dict = {}
        for _ in range(max(1, int(self.wait_s // PARK_SLICE_S))):
            if self.resumed.wait(PARK_SLICE_S):
                break
            status = self._client().call("checkpoint.status", job_id=job_id)
            if status.get("state") not in (CheckpointState.DUMPING, CheckpointState.SAVED):
                break
        else:
            return ParkOutcome(
                CheckpointState.FAILED,
                reason=f"no dump within {self.wait_s:g} s; see "
                f"`spswap events` and {self.cfg.paths.log / 'spswapd.log'}",
            )
        status = self._client().call("checkpoint.status", job_id=job_id)
        if status.get("state") == CheckpointState.RESTORED:
            return ParkOutcome(
                CheckpointState.RESTORED,
                restart_count=int(status.get("restart_count", 0)),
                proxy_pid=status.get("proxy_pid"),
                timings_s=status.get("timings_s"),
                kept=bool(status.get("kept")),
            )
        return ParkOutcome(
            CheckpointState.FAILED, reason=str(status.get("reason") or status.get("state"))
        )

    def status(self, job_id: str) -> dict[str, Any]:
        """The job's checkpoint status as spswapd has it (``checkpoint.status``)."""
        status: dict[str, Any] = Client(self.cfg, timeout_s=5.0).call("checkpoint.status",
                                                                     job_id=job_id)  # fmt: skip
        return status

    def restore(self, job_id: str, identity: dict[str, str], restart_count: int) -> dict[str, Any]:
        """Bring the job's instance back; raises CheckpointFailed (cold start) otherwise."""
        result: dict[str, Any] = Client(self.cfg, timeout_s=RESTORE_TIMEOUT_S).call(
            "restore", job_id=job_id, restart_count=restart_count, **identity
        )
        return result


def stand_in_for(pid: int, stop_requested: Callable[[], str | None],
                 poll_s: float = 0.05,
                 left_job: Callable[[], bool] | None = None) -> str | None:  # fmt: skip
    """In a requeued run: wait while the restored instance ``pid`` lives, forwarding the
    first stop signal this run gets (``stop_requested`` names it, or None), and, once
    stopped, until ``left_job`` says it has left the job (parked by spswapd: kept alive,
    it would never exit). Returns the signal that stopped it: forwarded, or one that came
    just as it exited."""
    forwarded: str | None = None
    last_sent = 0.0
    while pid_alive(pid):
        if forwarded is not None and left_job is not None and left_job():
            break
        stop = stop_requested()
        if stop is not None and forwarded is None:
            forwarded = stop
        # Again every RESEND_S while it lives: a stop that reached it inside its park
        # (before it learned it was restored) is cleared there with the old run's.
        if forwarded is not None and time.monotonic() - last_sent >= RESEND_S:
            last_sent = time.monotonic()
            try:
                os.kill(pid, signal.Signals[forwarded])
            except ProcessLookupError:  # it ended just now
                break
        time.sleep(poll_s)
    return forwarded or stop_requested()


def process_tree(pid: int) -> list[tuple[int, int]]:
    """``pid`` and its descendants now, each with its start time (a pid reused later by
    another process is not the same process)."""
    return [(p, start) for p in process_tree_pids(pid)
            if (start := pid_start_time(p)) is not None]  # fmt: skip


# Python's multiprocessing resource tracker (vLLM's spawned processes have one): when the
# last process holding its pipe is gone it unlinks the named semaphores and shared memory
# they left. Killed with the rest, it leaves them in /dev/shm for good.
RESOURCE_TRACKER = b"from multiprocessing.resource_tracker import main"
TRACKER_WAIT_S = 2.0


def is_resource_tracker(cmdline: bytes) -> bool:
    """Whether ``cmdline`` (``/proc/PID/cmdline``) is a multiprocessing resource tracker."""
    return RESOURCE_TRACKER in cmdline


def end_left_behind(tree: list[tuple[int, int]], timeout_s: float = 10.0) -> list[int]:
    """End what is still running of a dead instance's ``tree`` (from :func:`process_tree`):
    e.g. its vLLM server, orphaned when the instance was killed, which would otherwise
    keep its GPU memory and serve no one. SIGKILL (nothing of it is to be saved), then
    wait until each has exited; a resource tracker is spared the kill and given
    :data:`TRACKER_WAIT_S` to clean up after the others and exit. Returns the pids that
    were running."""

    def running(pid: int, start: int) -> bool:
        if pid_start_time(pid) != start:
            return False
        try:  # a zombie has exited (its memory, GPU memory too, is given back)
            stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115
        except OSError:
            return False
        return stat[stat.rindex(")") + 2 :].split(" ", 1)[0] != "Z"

    def tracker(pid: int) -> bool:
        try:
            return is_resource_tracker(Path(f"/proc/{pid}/cmdline").read_bytes())
        except OSError:
            return False

    left = [(p, start) for p, start in tree if running(p, start)]
    trackers = [(p, start) for p, start in left if tracker(p)]
    others = [proc for proc in left if proc not in trackers]
    _kill(others)
    _wait_ended(others, running, timeout_s)
    _wait_ended(trackers, running, TRACKER_WAIT_S)  # the others gone: it cleans up, exits
    _kill(trackers)
    _wait_ended(trackers, running, timeout_s)
    return [p for p, _ in left]


def _kill(procs: list[tuple[int, int]]) -> None:
    for p, start in procs:
        if pid_start_time(p) != start:  # gone, and the pid may be another's now
            continue
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_ended(procs: list[tuple[int, int]], running: Callable[[int, int], bool],
                timeout_s: float) -> None:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while any(running(p, start) for p, start in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
