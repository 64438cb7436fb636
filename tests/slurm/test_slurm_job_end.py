"""Facts of Slurm 22.05 that the time of a stop rests on (the CI's real Slurm): a finished
batch job can be requeued with ``scontrol requeue`` and runs again; a requeued job ends
at once when its batch script exits with nothing left in its cgroup; what is left there
is SIGKILLed."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from spswap.slurm.backend import CliBackend
from tests.helpers.restore import running
from tests.slurm.conftest import SlurmCluster, wait_for


def _left_running(backend: CliBackend, job: str, t0: float, timeout_s: float = 30.0) -> float:
    """Seconds from ``t0`` until Slurm no longer shows ``job`` running or completing."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = backend.job(job)
        if info is None or info.state not in ("RUNNING", "COMPLETING"):
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"job {job} still running after {timeout_s} s")


def test_a_finished_batch_job_can_be_requeued(slurm_cluster: SlurmCluster) -> None:
    backend = CliBackend()
    marks = slurm_cluster.work / "finished-marks"
    job = slurm_cluster.sbatch(f'echo "start ${{SLURM_RESTART_COUNT:-0}}" >> {marks}',
                               "--requeue")  # fmt: skip
    wait_for("the job to finish", lambda: (i := backend.job(job)) is not None
             and i.state == "COMPLETED", timeout_s=60)  # fmt: skip
    backend.requeue(job)
    wait_for("its second run", lambda: "start 1" in marks.read_text(), timeout_s=90)
    info = backend.job(job)
    assert info is not None and info.restart_count == 1, info


@pytest.mark.parametrize("left", ["nothing", "a child"])
def test_a_requeued_job_ends_at_once_and_kills_what_stays_in_its_cgroup(
    slurm_cluster: SlurmCluster, left: str
) -> None:
    """``scontrol requeuehold`` (a turn of ``spswap bench turns``): a batch script that
    exits on the signal with nothing left in the job's cgroup ends the job within a few
    tenths of a second (0.24-0.41 s measured). A child still there when the script exits
    (here ``sleep 30 &``, deaf to SIGTERM) is SIGKILLed by slurmstepd, which then waits
    for the cgroup to empty in steps of a second (proctrack/cgroup's wait): the job's end
    took 0.14-2.1 s in the CI's runs, as the kill races the first look. So whatever a
    parked run left in its job dies with it: the tree goes out whole, and the run ends
    last."""
    backend = CliBackend()
    marks = slurm_cluster.work / f"end-marks-{left.replace(' ', '-')}"
    # The child ignores SIGTERM from its start (forked while the script itself ignores
    # TERM: slurmstepd signals the whole step) and would outlive any wait here by itself.
    child = "" if left == "nothing" else f"trap '' TERM; sleep 30 & echo $! > {marks}.child"
    script = f"""
{child}
trap 'exit 0' TERM
fifo=$(mktemp -u); mkfifo "$fifo"; exec 9<>"$fifo"; rm "$fifo"
echo ready >> {marks}.$SLURM_JOB_ID
while :; do read -t 1 -u 9; done
"""
    ends = []
    for _ in range(2):
        job = slurm_cluster.sbatch(script, "--requeue")
        wait_for("the job to run", Path(f"{marks}.{job}").exists, timeout_s=60)
        t0 = time.monotonic()
        subprocess.run(["scontrol", "requeuehold", job], check=True)
        ends.append(_left_running(backend, job, t0))
        if left != "nothing":
            pid = int(Path(f"{marks}.child").read_text())
            # the child's 30 s are far off: only Slurm's SIGKILL ends it this soon
            wait_for(f"the child left behind (pid {pid}) to be killed",
                     lambda p=pid: not running(p), timeout_s=10)  # fmt: skip
        subprocess.run(["scancel", job], check=False)
        wait_for("the job's end", lambda j=job: backend.job_alive(j) is False, timeout_s=60)
    print(f"requeued job's end with {left} left behind: {[f'{s:.2f}' for s in ends]} s")
    if left == "nothing":
        # well inside KillWait (5 s), the wait a script deaf to TERM would cost; a few
        # tenths here, but the polls are `scontrol` runs on a loaded CI machine
        assert max(ends) < 3.0, ends
