"""A multi-model job preempted whole, on the CI's real Slurm, as a normal user: the
multi-model template rendered with only its MODELS line changed, every model asked
through the job's endpoint, the job preempted by the user's own job on `high`, requeued
by Slurm; spswapd checkpoints the job's process tree (the router and one engine process
per model) and the requeued run restores all of them: every model answers again, each
answer the cold model's, and the requeued run came back from the checkpoint."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from spswap.multi.sbatch import MultiSbatchOptions, render_serve_multi
from spswap.serve.run_log import read_runs
from tests.slurm.cluster import UserShell, node_setting
from tests.slurm.conftest import SlurmCluster, wait_for

torch = pytest.importorskip("torch")
from spswap.engines.reference import save_checkpoint  # noqa: E402
from spswap.engines.reference_model import preset  # noqa: E402
from spswap.multi import http_api  # noqa: E402
from tests.helpers.reference import cold_answers  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
MAX_NEW = 6
PROMPT = [4, 8, 15, 16]


@pytest.mark.parametrize("way_back", ["kept", "image"])
def test_a_preempted_multi_model_job_comes_back_with_every_model(
    slurm_cluster: SlurmCluster, user_uid: int, way_back: str
) -> None:
    """``kept``: the node's default keeps the dumped tree alive; ``image``:
    SPSWAP_KEEP_BYTES=0, so CRIU restores the whole tree (the router and each engine
    process, every one the leader of its own session) from its image."""
    if way_back == "image":
        with node_setting(slurm_cluster, "SPSWAP_KEEP_BYTES=0"):
            _preempt_and_back(slurm_cluster, user_uid, way_back)
    else:
        _preempt_and_back(slurm_cluster, user_uid, way_back)


def _preempt_and_back(slurm_cluster: SlurmCluster, user_uid: int, way_back: str) -> None:
    from spswap.slurm.backend import CliBackend
    from tests.checkpoint.criu_helpers import criu_skip_reason

    if (why := criu_skip_reason()) is not None:
        pytest.skip(f"the requeued run restores through CRIU: {why}")
    top = Path(tempfile.mkdtemp(prefix="spswap-multi-", dir="/tmp"))
    models = [save_checkpoint(preset("tiny", seed=40 + i), top / f"m{i}") for i in range(3)]
    gid = pwd.getpwuid(user_uid).pw_gid
    for p in [top, *top.rglob("*")]:
        os.chown(p, user_uid, gid)
    top.chmod(0o700)
    script = top / "serve_multi.sbatch"
    text = render_serve_multi(MultiSbatchOptions(models=tuple(map(str, models)),
                                                 job_name="multi", engine="reference",
                                                 engine_args=()))  # fmt: skip
    # the node's two GPUs: the high job below (both) can only run by preempting this one
    script.write_text(text)
    os.chown(script, user_uid, -1)
    run = UserShell(slurm_cluster, user_uid, top).run

    sub = run("sbatch", "--parsable", str(script))
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    state = top / ".spswap" / job
    log_path = top / f"multi-{job}.log"
    cold = {m.name: cold_answers(m, [PROMPT], MAX_NEW)[0] for m in models}
    socket: list[Path] = []

    def serving() -> bool:
        found = re.findall(r"3 models on (\S+) \(", log_path.read_text()) \
            if log_path.exists() else []  # fmt: skip
        socket[:] = [Path(found[-1])] if found else []
        return bool(found) and socket[0].exists()

    def ask_all(tag: str) -> dict[str, list[int]]:
        got = {}
        for m in models:
            answer = http_api.complete(socket[0], m.name, PROMPT, MAX_NEW,
                                       request_id=f"{tag}-{m.name}", timeout_s=120)  # fmt: skip
            assert answer["status"] == 200, (answer, log_path.read_text())
            got[m.name] = answer["choices"][0]["token_ids"]
        return got

    try:
        wait_for("the job's endpoint", serving, timeout_s=240)
        assert ask_all("first") == cold
        high = run("sbatch", "--parsable", "--partition=high", "--gres=gpu:2",
                   "--output=/dev/null", "--wrap", "sleep 2")  # fmt: skip
        assert high.returncode == 0, high.stderr
        wait_for("the requeued run", lambda: any(r.restart_count == 1 for r in read_runs(state)),
                 timeout_s=300)  # fmt: skip
        wait_for("the endpoint again", serving, timeout_s=120)
        log = log_path.read_text()
        (back,) = [r for r in read_runs(state) if r.restart_count == 1]
        assert back.path.value == way_back, (back, log)
        assert "stopped by SIGUSR1: asleep, handed to spswapd for the job's next run" in log, log
        # the restored run says what it took up (nothing was queued at this stop)
        assert "into run 1; weights back in" in log and "; 0 saved request(s) to resume" in log, log
        assert ask_all("again") == cold, log
        # the same process tree serves: no model was started again in the requeued run
        assert log.count("m0 up from the pool") == 1, log
        CliBackend().cancel(job)
        # one stop, one stop line: the run that stood in says only that it did
        wait_for("the requeued run's last line", lambda: "run 1 ends: it stood in for the "
                 "job's restored models" in log_path.read_text(), timeout_s=60,
                 detail=log_path.read_text)  # fmt: skip
        log = log_path.read_text()
        assert "; stopped (" not in log
        # the restored models' own last line: the stop, what they answered, their engines
        assert "spswap serve: stopped by SIGTERM; its 3 models answered " in log, log
        assert "since they started (m0 " in log and "and their engines ended" in log, log
    finally:
        CliBackend().cancel(job)
        wait_for("the job to end", lambda: CliBackend().job_alive(job) is False, timeout_s=60)
        shutil.rmtree(top, ignore_errors=True)
