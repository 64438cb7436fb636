"""The run's process under Slurm: it ends when its instance exits or leaves the job, not
when Slurm's KillWait kills a kept instance's run (spswap.serve.run_watch)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from spswap.serve import run_watch
from spswap.serve.checkpointer import stand_in_for
from spswap.serve.run_watch import RunWatch, in_job_cgroup, parked_away

V2_JOB = "0::/system.slice/slurmstepd.scope/job_42/step_batch/user/task_0\n"
V1_JOB = ("12:freezer:/slurm/uid_1001/job_42/step_batch\n"
          "4:memory:/slurm/uid_1001/job_42/step_batch\n")  # fmt: skip
V2_PARKED = "0::/system.slice/spswapd.service/spswap-parked-b11caf3f-42-1648\n"
V1_PARKED = ("12:freezer:/spswap-parked-b11caf3f-42-1648\n"
             "4:memory:/slurm/uid_1001/job_42/step_batch\n")  # fmt: skip


def test_in_job_cgroup_v2_and_v1() -> None:
    assert in_job_cgroup(V2_JOB, "42") and in_job_cgroup(V1_JOB, "42")
    assert not in_job_cgroup(V2_JOB, "4") and not in_job_cgroup(V2_JOB, "420")
    assert not in_job_cgroup("0::/user.slice/user-0.slice/session-3.scope\n", "42")
    assert not in_job_cgroup("", "42")


def test_parked_away_v2_and_v1() -> None:
    assert parked_away(V2_PARKED) and parked_away(V1_PARKED)
    assert not parked_away(V2_JOB) and not parked_away(V1_JOB) and not parked_away("")


def test_left_job_needs_the_park_and_the_daemons_word(monkeypatch: pytest.MonkeyPatch) -> None:
    texts = {7: V2_JOB}
    monkeypatch.setattr(run_watch, "_cgroup_text", lambda pid: texts[pid])
    asked: list[str] = []

    def status(job_id: str) -> dict[str, Any]:
        asked.append(job_id)
        return {"state": "dumping", "pid": 7, "left_job": True}

    assert not run_watch.left_job(7, "42", status) and asked == []  # not parked: no call
    texts[7] = V2_PARKED
    assert run_watch.left_job(7, "42", status) and asked == ["42"]
    assert not run_watch.left_job(7, "42", lambda j: {"state": "dumping", "pid": 7})
    assert not run_watch.left_job(7, "42", lambda j: {"left_job": True, "pid": 8})

    def away(job_id: str) -> dict[str, Any]:
        raise OSError("spswapd is restarting")

    assert not run_watch.left_job(7, "42", away)


def _child(code: str) -> int:
    pid = os.fork()
    if pid == 0:  # a real child process, as the fork of `spswap serve` makes it
        try:
            for sig in run_watch.FORWARDED:  # not the handlers an earlier watch left here
                signal.signal(sig, signal.SIG_DFL)
            exec(code, {"os": os, "signal": signal, "time": time})
        finally:
            os._exit(3)
    return pid


def test_watch_returns_the_instances_exit_code() -> None:
    pid = _child("os._exit(7)")
    assert RunWatch(pid, "42", lambda j: {}).wait() == 7


def test_watch_forwards_a_stop_and_reports_a_signal_death() -> None:
    # the child dies of the forwarded SIGTERM: the run ends with 128 + 15, as a shell says
    pid = _child("time.sleep(30)")
    watch = RunWatch(pid, "42", lambda j: {})
    previous = signal.getsignal(signal.SIGTERM)
    try:
        # the handler first: a stall between the two lines must not let SIGALRM kill pytest
        signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        t0 = time.monotonic()
        assert watch.wait() == 128 + signal.SIGTERM
        assert time.monotonic() - t0 < 5
    finally:
        for sig in run_watch.FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


def test_watch_ends_when_the_instance_left_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    # a kept instance never exits: the watch must end on spswapd's word, long before it
    pid = _child("time.sleep(30)")
    t0 = time.monotonic()
    parked_at = t0 + 0.3
    monkeypatch.setattr(
        run_watch, "_cgroup_text", lambda p: V2_PARKED if time.monotonic() > parked_at else V2_JOB
    )
    try:
        assert RunWatch(pid, "42", lambda j: {"pid": pid, "left_job": True}).wait() == 0
        assert 0.25 < time.monotonic() - t0 < 5
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), "the instance lives on"
    finally:
        for sig in run_watch.FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_stand_in_ends_once_its_stopped_instance_left_the_job() -> None:
    # the instance ignores the forwarded SIGTERM, as a parked (frozen) one stays alive
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"  # deaf to TERM
        t0 = time.monotonic()
        left_at = t0 + 0.3
        stopped = stand_in_for(proc.pid, lambda: "SIGTERM", poll_s=0.01,
                               left_job=lambda: time.monotonic() > left_at)  # fmt: skip
        assert stopped == "SIGTERM"
        assert 0.25 < time.monotonic() - t0 < 5
        assert proc.poll() is None, "the instance lives on where it was parked"
    finally:
        proc.kill()
        proc.wait()


def test_fork_instance_does_not_fork_outside_a_job_cgroup() -> None:
    # this test process is in no Slurm job's cgroup (CI runs pytest outside Slurm)
    if in_job_cgroup(open("/proc/self/cgroup").read(), "42"):
        pytest.skip("this test runs inside Slurm job 42")
    assert run_watch.fork_instance(None, lambda j: {}) is None
    assert run_watch.fork_instance("42", lambda j: {}) is None


def _fake_job(tmp_path: Any, procs: dict[str, list[int]], comms: dict[int, str]) -> Any:
    """A /proc of this process inside job 42's v2 cgroup, on a stand-in cgroupfs whose
    job directories hold ``procs`` (relative dir -> pids); ``comms``: each pid's name."""
    cg, proc = tmp_path / "cg", tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(V2_JOB)
    (proc / "self" / "mountinfo").write_text(
        f"41 31 0:38 / {cg} rw,relatime - cgroup2 cgroup2 rw\n"
    )
    job = cg / "system.slice/slurmstepd.scope/job_42"
    for rel, pids in procs.items():
        (job / rel).mkdir(parents=True, exist_ok=True)
        (job / rel / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    for pid, comm in comms.items():
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "comm").write_text(comm + "\n")
    return proc


def test_left_in_job_names_what_stays_in_the_jobs_cgroup(tmp_path: Any) -> None:
    """What makes Slurm wait at a run's end: every process of the job's cgroup, in any
    of its sub-cgroups, but the run, the batch shell and slurmstepd."""
    proc = _fake_job(
        tmp_path,
        {"step_batch/slurm": [10], "step_batch/user/task_0": [20, 21, 30], "step_extern": [40]},
        {10: "slurmstepd", 20: "spswap", 21: "bash", 30: "pt_main_thread", 40: "sleep"},
    )
    left = run_watch.left_in_job("42", {20, 21}, proc)
    assert left == [(30, "pt_main_thread"), (40, "sleep")]
    assert run_watch.left_in_job("42", {20, 21, 30, 40}, proc) == []
    assert run_watch.left_in_job("7", {20}, proc) == []  # not this job's


def test_left_message_exact_text() -> None:
    assert run_watch.left_message([(30, "pt_main_thread"), (40, "sleep")]) == (
        "spswap serve: the run ends with 2 process(es) of the job still in its cgroup: "
        "pid 30 (pt_main_thread), pid 40 (sleep); Slurm ends the job once they are gone"
    )
    many = [(i, "x") for i in range(10)]
    assert run_watch.left_message(many, shown=2) == (
        "spswap serve: the run ends with 10 process(es) of the job still in its cgroup: "
        "pid 0 (x), pid 1 (x) and 8 more; Slurm ends the job once they are gone"
    )
