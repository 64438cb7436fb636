"""A stand-in for spswapd's side of a restore, for CPU tests of the serve lifecycle's
decisions without CRIU (the real restore is tested in tests/checkpoint, as root with
CRIU): ``restore`` starts a real process as "the restored instance" and returns what
spswapd returns; the instance runs ``instance_code`` (Python), which may start children
and then end on its own, as a crashed instance would."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from spswap.daemon.statuses import CheckpointState
from spswap.errors import CheckpointFailed
from spswap.serve.checkpointer import ParkOutcome

ROOT = Path(__file__).resolve().parents[2]


class RestoreStandIn:
    """Plays spswapd for one requeued run: ``restore`` once; a ``park`` is refused."""

    def __init__(self, instance_code: str | None, *, refuse: str | None = None) -> None:
        self.instance_code = instance_code
        self.refuse = refuse  # restore refused with this reason (CheckpointFailed)
        self.restored: list[dict[str, Any]] = []
        self.parked: list[dict[str, str]] = []
        self.first_line = ""  # what the instance printed first (e.g. a child's pid)
        self.proc: subprocess.Popen[str] | None = None
        self.run_started_s: float | None = None  # not forked from a run's process

    def status(self, job_id: str) -> dict[str, Any]:
        """The instance never parks here: it has not left the job."""
        return {"job_id": job_id, "state": "restored"}

    def restore(self, job_id: str, identity: dict[str, str], restart_count: int
                ) -> dict[str, Any]:  # fmt: skip
        self.restored.append({"job_id": job_id, "identity": identity,
                              "restart_count": restart_count})  # fmt: skip
        if self.refuse is not None:
            raise CheckpointFailed(self.refuse)
        assert self.instance_code is not None
        self.proc = subprocess.Popen([sys.executable, "-c", self.instance_code], cwd=ROOT,
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert self.proc.stdout is not None
        self.first_line = self.proc.stdout.readline().strip()  # up: it says so
        # spswapd reaps the restored tree's root (its child); so does this thread
        threading.Thread(target=self.proc.wait, daemon=True).start()
        return {"pid": self.proc.pid, "kept": False, "timings_s": {"restore": 0.01}}

    def park(self, job_id: str, identity: dict[str, str], *, requeue: bool = False
             ) -> ParkOutcome:  # fmt: skip
        """A dump at the run's stop is refused (nothing here can take one)."""
        self.parked.append(identity)
        return ParkOutcome(CheckpointState.FAILED, reason="no dump in this test")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has exited: its memory is given back)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split(" ", 1)[0] != "Z"


# A restored instance that starts a child (what a vLLM server is to its spswap serve)
# and then dies with its work undone (a crash): the child is left running.
DIES_LEAVING_A_CHILD = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
time.sleep(2.0)  # (the run reads its tree first, even on a loaded machine)
os._exit(9)
"""
