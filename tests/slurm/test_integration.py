"""Against a REAL slurmctld + slurmd + munge (scripts/slurm_up.sh, 2 fake GPUs),
with the project's own prolog and epilog. SPSWAP_TEST_SLURM=1 to run."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from spswap.slurm.backend import CliBackend, get_backend
from spswap.slurm.env import JobEnv

from .cluster import DEFAULTS_FILE, SlurmCluster, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture
def backend(slurm_cluster: SlurmCluster) -> CliBackend:
    found = get_backend()
    assert isinstance(found, CliBackend)  # no pyslurm matches Slurm 22.05 here
    return found


def _state(backend: CliBackend, job_id: str) -> str | None:
    info = backend.job(job_id)
    return info.state if info else None


def _env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def test_job_environment_has_its_fake_gpu(slurm_cluster: SlurmCluster, backend: CliBackend) -> None:
    out = slurm_cluster.work / "env-gpu"
    job = slurm_cluster.sbatch(f"env > {out}.tmp; mv {out}.tmp {out}", "--gres=gpu:1",
                               "--comment=model:tiny")  # fmt: skip
    wait_for("the job's environment", out.exists)
    env = JobEnv.from_env(_env_file(out))
    assert env is not None
    assert (env.job_id, env.restart_count, env.uid, env.user, env.partition) == (
        job,
        0,
        0,
        "root",
        "debug",
    )
    assert len(env.gpus) == 1 and env.gpus[0] in (0, 1)
    # the prolog ran for this job (spswap's outcome is logged, whatever it was)
    wait_for("the prolog's log line",
             lambda: f"job={job} prolog:" in slurm_cluster.hook_log("prolog"))  # fmt: skip


def test_backend_running_then_cancelled(slurm_cluster: SlurmCluster, backend: CliBackend) -> None:
    job = slurm_cluster.sbatch("sleep 60", "--gres=gpu:1")
    wait_for("RUNNING", lambda: _state(backend, job) == "RUNNING")
    info = backend.job(job)
    assert info is not None and len(info.gpus) == 1 and info.uid == 0
    assert backend.job_alive(job) is True
    assert any(j.job_id == job for j in backend.jobs())
    backend.cancel(job)
    wait_for("the cancelled job to end", lambda: backend.job_alive(job) is False)
    assert _state(backend, job) == "CANCELLED"
    assert backend.job("999999") is None
    assert backend.job_alive("999999") is False


def test_requeue_increments_restart_count(slurm_cluster: SlurmCluster, backend: CliBackend) -> None:
    marks = slurm_cluster.work / "requeue-marks"
    job = slurm_cluster.sbatch(
        f'echo "run ${{SLURM_RESTART_COUNT:-0}}" >> {marks}; sleep 60', "--requeue"
    )
    wait_for("the first run", lambda: marks.exists() and "run 0" in marks.read_text())
    requeued_s = time.time()
    backend.requeue(job)
    wait_for("the rerun", lambda: "run 1" in marks.read_text(), timeout_s=40)
    rerun_seen_s = time.time()
    info = backend.job(job)
    assert info is not None and info.restart_count == 1 and info.state == "RUNNING"
    # the rerun waited for its EligibleTime: its requeue + cred_expire (5 here) + 1 s, the
    # floor under every requeued run's start that `spswap bench turns` reports as a wait
    assert info.eligible_s is not None and info.eligible_s >= int(requeued_s) + 5, info
    assert rerun_seen_s >= info.eligible_s
    backend.cancel(job)


def _preemptable_running(cluster: SlurmCluster, script: str, marks: Path) -> str:
    """A requeueable job on ``low`` holding both GPUs (a ``high`` job preempts it), with
    USR1 at preemption; returns its id once its script wrote ``start 0`` to ``marks``."""
    job = cluster.sbatch(script, "--partition=low", "--gres=gpu:2", "--requeue",
                         "--signal=B:USR1@60")  # fmt: skip
    wait_for("the low job to run", lambda: marks.exists() and "start 0" in marks.read_text())
    return job


def test_preemption_sends_usr1_then_requeues(
    slurm_cluster: SlurmCluster, backend: CliBackend
) -> None:
    marks = slurm_cluster.work / "preempt-marks"
    # the handlers only record (builtin echo, no fork): a forking handler lost a signal
    script = f"""
echo "start ${{SLURM_RESTART_COUNT:-0}} $SLURM_JOB_GPUS" >> {marks}
[ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ] && exit 0
trap 'echo usr1 >> {marks}' USR1
trap 'echo term >> {marks}; exit 0' TERM
while :; do sleep 1 & wait $!; done
"""
    low = _preemptable_running(slurm_cluster, script, marks)
    submitted = time.monotonic()
    high = slurm_cluster.sbatch("sleep 3", "--partition=high", "--gres=gpu:1")
    wait_for("USR1 at preemption", lambda: "usr1" in marks.read_text(), timeout_s=15)
    usr1_after_s = time.monotonic() - submitted
    wait_for("SIGTERM after GraceTime", lambda: "term" in marks.read_text(),
             timeout_s=slurm_cluster.grace_time_s + 40)  # fmt: skip
    term_after_s = time.monotonic() - submitted
    wait_for("the requeued rerun", lambda: "start 1" in marks.read_text(), timeout_s=60)
    lines = marks.read_text().split("\n")
    assert [line.split(" ")[0] for line in lines if line] == ["start", "usr1", "term", "start"]
    assert usr1_after_s < 10, "USR1 must come at preemption (preempt_send_user_signal)"
    assert term_after_s >= slurm_cluster.grace_time_s - 1, "SIGTERM only after GraceTime"
    info = backend.job(low)
    assert info is not None and info.restart_count == 1
    wait_for("the high job to finish", lambda: backend.job_alive(high) is False, timeout_s=30)


def test_a_preempted_job_that_ends_in_its_grace_time_is_not_requeued_by_slurm(
    slurm_cluster: SlurmCluster, backend: CliBackend
) -> None:
    """Why spswapd requeues a preempted job itself (once its tree has left the job): Slurm
    22.05 does not requeue a job selected for preemption that ends by itself within its
    GraceTime; it completes, and is gone. (slurm.conf(5) suggests otherwise; tried here,
    2026-12-03. That requeue of the running job is a kill, and slurmd checks a killed
    job's end once a second: part of every preemption's time is Slurm's.)"""
    marks = slurm_cluster.work / "grace-marks"
    script = f"""
echo "start ${{SLURM_RESTART_COUNT:-0}}" >> {marks}
on_usr1() {{
    echo usr1 >> {marks}; touch {marks}.usr1
    while [ -e {marks}.usr1 ]; do sleep 0.1; done
}}
trap 'on_usr1; exit 0' USR1
trap 'echo term >> {marks}; exit 0' TERM
while :; do sleep 1 & wait $!; done
"""
    low = _preemptable_running(slurm_cluster, script, marks)
    high = slurm_cluster.sbatch("sleep 1", "--partition=high", "--gres=gpu:1")
    flag = Path(f"{marks}.usr1")
    wait_for("USR1 at preemption", flag.exists, timeout_s=15)
    flag.unlink()  # the job ends now, by itself, in its GraceTime
    wait_for("the low job's end", lambda: backend.job_alive(low) is False, timeout_s=30)
    wait_for("the high job to finish", lambda: backend.job_alive(high) is False, timeout_s=30)
    time.sleep(3)  # a requeued job would be pending again by now
    info = backend.job(low)
    assert info is not None and info.state == "COMPLETED" and info.restart_count == 0, info
    assert [x.split(" ")[0] for x in marks.read_text().split("\n") if x] == ["start", "usr1"]


def test_signal_batch_reaches_the_batch_shell(
    slurm_cluster: SlurmCluster, backend: CliBackend
) -> None:
    marks = slurm_cluster.work / "signal-marks"
    script = f"""
trap 'echo usr1 >> {marks}' USR1
echo ready >> {marks}
while :; do sleep 1 & wait $!; done
"""
    job = slurm_cluster.sbatch(script)
    wait_for("the job to be ready", lambda: marks.exists() and "ready" in marks.read_text())
    backend.signal_batch(job, "SIGUSR1")
    wait_for("USR1 in the batch shell", lambda: "usr1" in marks.read_text(), timeout_s=10)
    backend.cancel(job)


def test_prolog_without_spswap_leaves_the_node_in_service(
    slurm_cluster: SlurmCluster, backend: CliBackend
) -> None:
    saved = DEFAULTS_FILE.read_text()
    DEFAULTS_FILE.write_text(
        saved.replace(f"SPSWAP_BIN={slurm_cluster.spswap_bin}", "SPSWAP_BIN=/nonexistent/spswap")
    )
    try:
        job = slurm_cluster.sbatch("true", "--gres=gpu:1")
        wait_for("the job to complete", lambda: _state(backend, job) == "COMPLETED")
    finally:
        DEFAULTS_FILE.write_text(saved)
    assert f"job={job} prolog: spswap executable not found" in slurm_cluster.hook_log("prolog")
    wait_for("the epilog's log line",
             lambda: f"job={job} epilog: spswap executable not found"
             in slurm_cluster.hook_log("epilog"))  # fmt: skip
    wait_for("the node back to idle", lambda: slurm_cluster.node_state() == "idle")
    # a failing `spswap node prolog` (whatever it does today) must not drain it either
    job = slurm_cluster.sbatch(f"{slurm_cluster.spswap_bin} --version", "--gres=gpu:1")
    wait_for("the job to complete", lambda: _state(backend, job) == "COMPLETED")
    wait_for("the node back to idle", lambda: slurm_cluster.node_state() == "idle")


def test_unreachable_controller_is_unknown_not_dead(
    slurm_cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = Path("/etc/slurm/slurm.conf").read_text()
    bad = tmp_path / "slurm.conf"
    bad.write_text(conf + "SlurmctldPort=9\n")  # nothing listens there
    monkeypatch.setenv("SLURM_CONF", str(bad))
    assert CliBackend(timeout_s=5).job_alive("1") is None
    proc = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    assert "DOWN" in proc.stdout


def test_prolog_daemon_outlives_the_job_and_is_reused(
    slurm_cluster: SlurmCluster, backend: CliBackend
) -> None:
    """The prolog starts spswapd detached: it survives the prolog and the job, and the
    next job's prolog finds the same daemon; both jobs are recorded."""
    from spswap.config import Config
    from spswap.daemon import lifecycle
    from spswap.daemon.client import Client

    cfg = Config.from_env({}, root=slurm_cluster.spswap_root)
    first = slurm_cluster.sbatch("true", "--gres=gpu:1")
    wait_for("the first job to complete", lambda: _state(backend, first) == "COMPLETED")
    pid = wait_for("the daemon", lambda: lifecycle.daemon_running(cfg))
    assert lifecycle.ping(cfg)
    second = slurm_cluster.sbatch("true", "--gres=gpu:1")
    wait_for("the second job to complete", lambda: _state(backend, second) == "COMPLETED")
    assert lifecycle.daemon_running(cfg) == pid and lifecycle.ping(cfg)
    jobs = {j["job_id"]: j for j in Client(cfg).call("jobs.list")}
    assert {first, second} <= set(jobs)
    wait_for(
        "the epilogs",
        lambda: all(
            j["state"] != "running"
            for j in Client(cfg).call("jobs.list")
            if j["job_id"] in (first, second)
        ),
    )


def test_images_of_finished_jobs_are_collected(
    slurm_cluster: SlurmCluster, backend: CliBackend, tmp_path: Path
) -> None:
    """The epilog cannot tell a requeued job from a finished one; a later prolog asks
    Slurm again and drops the images of jobs that ended or that it no longer knows."""
    from spswap.config import Config
    from spswap.daemon.job_ops import collect_images
    from spswap.daemon.state import DaemonState

    cfg = Config.from_env({}, root=tmp_path / "root")
    done = slurm_cluster.sbatch("true")
    wait_for("the job to complete", lambda: _state(backend, done) == "COMPLETED")
    running = slurm_cluster.sbatch("sleep 60")
    wait_for("RUNNING", lambda: _state(backend, running) == "RUNNING")
    for job in (done, running, "999999"):
        (cfg.paths.images / f"job{job}-0123456789abcdef-01234567-89abcdef").mkdir(parents=True)
    try:
        info = backend.job(running)
        assert info is not None and info.nodes  # the node it runs on, as Slurm names it
        here = DaemonState(cfg, node_names={"another-node", info.nodes})
        assert collect_images(here, current_job="1") == [done, "999999"]
        left = [p.name.split("-")[0] for p in cfg.paths.images.iterdir()]
        assert left == [f"job{running}"]  # a job running here keeps its images
        # the same job seen from another node (its run moved there): nothing here will
        # be restored, and an image would roll back what the job does there
        other = DaemonState(cfg, node_names={"another-node"})
        assert collect_images(other, current_job="1") == [running]
        assert not list(cfg.paths.images.iterdir())
        assert f"runs on {info.nodes} now, not on another-node" in cfg.paths.events.read_text()
    finally:
        backend.cancel(running)


def test_a_run_whose_prolog_never_came_is_registered_at_its_first_request(
    slurm_cluster: SlurmCluster, backend: CliBackend, tmp_path: Path
) -> None:
    """slurmd does not always run the prolog of a requeued job that comes straight back
    (seen in this suite: the restore of the new run was refused, "job ... is ended"): the
    new run is registered when it first asks, once Slurm says it runs here, as its user."""
    import os

    from spswap.config import Config
    from spswap.daemon.ckpt_status import running_job
    from spswap.daemon.jobs import JobRecord
    from spswap.daemon.state import Context, DaemonState
    from spswap.errors import CheckpointFailed

    cfg = Config.from_env({}, root=tmp_path / "root")
    job = slurm_cluster.sbatch("sleep 60", "--gres=gpu:1")
    wait_for("RUNNING", lambda: _state(backend, job) == "RUNNING")
    try:
        info = backend.job(job)
        assert info is not None and info.nodes
        # what the last run's epilog left, and no prolog since
        ended = JobRecord(job_id=job, uid=os.getuid(), user="root", gpus=[1], state="ended",
                          registered_at=1.0, ended_at=2.0)  # fmt: skip
        elsewhere = DaemonState(cfg, node_names={"another-node"})
        elsewhere.jobs.put(ended)
        with pytest.raises(CheckpointFailed, match="Slurm does not say a new run"):
            running_job(Context(peer_uid=0, peer_pid=os.getpid(), state=elsewhere), job)
        assert elsewhere.jobs.get(job) == ended  # on another node: nothing registered
        here = DaemonState(cfg, node_names={info.nodes})
        rec = running_job(Context(peer_uid=0, peer_pid=os.getpid(), state=here), job)
        assert rec.state == "running" and rec.restart_count == info.restart_count
        assert rec.gpus == list(info.gpus)  # Slurm's, not the last run's
        assert here.jobs.get(job) == rec
        assert "no prolog reached spswapd" in cfg.paths.events.read_text()
    finally:
        backend.cancel(job)
