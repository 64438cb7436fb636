"""docs/slurm.md's user guide as written, on the CI's real Slurm, by a normal user: the
serve template rendered with only its MODEL line changed, submitted as the user, asked
from outside the job with `spswap ask --job N`, preempted by the user's own job on the
`high` partition, requeued by Slurm, asked again; every answer is the cold model's, and
the requeued run came back from its checkpoint (kept or image)."""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from pathlib import Path

import pytest

from spswap.serve.run_log import read_runs
from spswap.serve.sbatch import SbatchOptions, render_serve
from tests.slurm.cluster import UserShell
from tests.slurm.conftest import SlurmCluster, wait_for

torch = pytest.importorskip("torch")
from spswap.engines.reference import save_checkpoint  # noqa: E402
from spswap.engines.reference_model import preset  # noqa: E402
from tests.helpers.reference import cold_answers  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
MAX_NEW = 8


def test_the_user_guide_as_written(slurm_cluster: SlurmCluster, user_uid: int) -> None:
    from spswap.slurm.backend import CliBackend
    from tests.checkpoint.criu_helpers import criu_skip_reason

    if (why := criu_skip_reason()) is not None:
        pytest.skip(f"the requeued run restores through CRIU: {why}")
    top = Path(tempfile.mkdtemp(prefix="spswap-guide-", dir="/tmp"))
    model = save_checkpoint(preset("tiny", seed=5), top / "model")
    for p in [top, *top.rglob("*")]:
        os.chown(p, user_uid, pwd.getpwuid(user_uid).pw_gid)
    top.chmod(0o700)
    # the template as the guide gives it, with only the CHANGE line changed
    script = top / "serve.sbatch"
    # both GPUs: the high job below (one GPU) can only run by preempting it
    script.write_text(render_serve(SbatchOptions(model=str(model), partition="low",
                                                 job_name="guide", gpus=2)))  # fmt: skip
    os.chown(script, user_uid, -1)
    run = UserShell(slurm_cluster, user_uid, top).run

    sub = run("sbatch", "--parsable", str(script))
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    state = top / ".spswap" / job
    want, later = cold_answers(model, [[7, 8, 9], [5, 6, 7]], MAX_NEW)
    try:
        # asked as soon as Slurm says it runs (the walk's "once the job runs"): the server
        # makes its spool a few seconds later, and `spswap ask --job` waits for it
        wait_for("the job to run", lambda: (i := CliBackend().job(job)) is not None
                 and i.state == "RUNNING", timeout_s=180)  # fmt: skip
        first = run(slurm_cluster.spswap_bin, "ask", "7,8,9", "--max-new-tokens", str(MAX_NEW),
                    "--job", job)  # fmt: skip
        assert first.returncode == 0 and first.stdout.strip() == ",".join(map(str, want)), first
        high = run("sbatch", "--parsable", "--partition=high", "--gres=gpu:1",
                   "--output=/dev/null", "--wrap", "sleep 2")  # fmt: skip
        assert high.returncode == 0, high.stderr
        # asked while the job is away (requeued, waiting for the high job): saved
        wait_for("the job to wait for its next run",
                 lambda: (i := CliBackend().job(job)) is not None and i.state == "PENDING",
                 timeout_s=120)  # fmt: skip
        away = run(slurm_cluster.spswap_bin, "ask", "5,6,7", "--max-new-tokens", str(MAX_NEW),
                   "--job", job, "--id", "later", "--timeout-s", "1")  # fmt: skip
        assert away.returncode == 1 and "ask again later with --id later" in away.stderr, away
        wait_for("the requeued run", lambda: any(r.restart_count == 1 for r in read_runs(state)),
                 timeout_s=240)  # fmt: skip
        fetched = run(slurm_cluster.spswap_bin, "ask", "--job", job, "--id", "later")
        assert fetched.returncode == 0 and fetched.stdout.strip() == ",".join(map(str, later)), \
            fetched  # fmt: skip
        again = run(slurm_cluster.spswap_bin, "ask", "7,8,9", "--max-new-tokens", str(MAX_NEW),
                    "--job", job, "--id", "again")  # fmt: skip
        assert again.returncode == 0 and again.stdout.strip() == first.stdout.strip(), again
        (back,) = [r for r in read_runs(state) if r.restart_count == 1]
        log = (top / f"guide-{job}.log").read_text()
        assert back.path.value in ("kept", "image"), (back, log)
        assert "stopped by SIGUSR1: asleep, handed to spswapd for the job's next run" in log, log
        assert f"job {job} run 1: Slurm requeued the job (its 'CANCELLED" in log, log
        assert " into run 1; weights back in " in log and \
            "; 1 saved request(s) to resume" in log, log  # fmt: skip
        CliBackend().cancel(job)
        # one stop, one line of each: the restored instance counts its own run's answers,
        # its run says only that it stood in for it
        wait_for("the restored run's last line", lambda: "run 1 ends: it stood in for its "
                 "restored instance" in (top / f"guide-{job}.log").read_text(),
                 timeout_s=60)  # fmt: skip
        log = (top / f"guide-{job}.log").read_text()
        assert "answered 2 in run 1, 3 in all the job's runs" in log, log
    finally:
        CliBackend().cancel(job)
        wait_for("the job to end", lambda: CliBackend().job_alive(job) is False, timeout_s=60)
        shutil.rmtree(top, ignore_errors=True)
