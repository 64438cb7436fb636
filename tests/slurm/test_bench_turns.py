"""`spswap bench turns` on the CI's real Slurm, run by a normal user as a user runs it:
K=3 reference models, 2 rounds, every turn after the cold ones restored through CRIU (as
the job's user), every answer equal to the model's cold answer (and to an in-process
engine's), and nothing left behind: no job, slot, pool use, image or process."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from spswap.bench.turns import DEFAULT_PROMPT
from tests.slurm.cluster import UserShell, as_user
from tests.slurm.conftest import SlurmCluster, wait_for

torch = pytest.importorskip("torch")
from tests.helpers.reference import cold_answers  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_bench_turns_as_a_normal_user(slurm_cluster: SlurmCluster, user_uid: int) -> None:
    from tests.checkpoint.criu_helpers import criu_skip_reason

    if (why := criu_skip_reason()) is not None:
        pytest.skip(f"the turns restore through CRIU: {why}")
    probe = subprocess.run([*as_user(user_uid), slurm_cluster.spswap_bin, "--version"],
                           capture_output=True, text=True)  # fmt: skip
    if probe.returncode != 0:
        pytest.fail(f"{slurm_cluster.spswap_bin} cannot be run by a normal user "
                    f"({probe.stderr.strip()}): scripts/install.sh must build the venv from "
                    "a Python every user can run")  # fmt: skip
    top = Path(tempfile.mkdtemp(prefix="spswap-turns-", dir="/tmp"))
    os.chown(top, user_uid, pwd.getpwuid(user_uid).pw_gid)
    top.chmod(0o700)
    try:
        proc = UserShell(slurm_cluster, user_uid, top).run(
            slurm_cluster.spswap_bin, "bench", "turns", "--partition", "low", "--gpus", "2",
            "--rounds", "2", "--work-dir", str(top / "work"), "--json", "--out",
            str(top / "turns.json"), timeout_s=1200,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        report = json.loads(proc.stdout)
        assert report == json.loads((top / "turns.json").read_text())
        turns = report["turns"]
        assert [t["kind"] for t in turns] == ["cold"] * 3 + ["restore"] * 6, turns
        assert all(t["path"] in ("kept", "image") and t["identical"] for t in turns[3:]), turns
        assert all(t["path"] == "cold" for t in turns[:3]), turns
        assert (report["identical"], report["compared"], report["leftovers"]) == (6, 6, [])
        assert report["settings"]["user"] == pwd.getpwuid(user_uid).pw_name
        for t in turns:
            assert t["total_s"] == pytest.approx(t["slurm_s"] + t["spswap_s"], abs=1e-6)
            assert 0 <= t["requeue_wait_s"] <= t["slurm_s"], t
        print("turns (model, path, Slurm s, of it requeue wait s):",
              [(t["model"], t["path"], round(t["slurm_s"], 2), round(t["requeue_wait_s"], 2))
               for t in turns])  # fmt: skip
        # the product's cold answer is the engine's own
        max_new = report["settings"]["max_new_tokens"]
        outbox = {t["model"]: top / "work" / ".spswap" / report["job_ids"][t["model"]]
                  / "outbox" / f"turn{t['turn']:03d}.json" for t in turns[:3]}  # fmt: skip
        for name, path in outbox.items():
            assert [json.loads(path.read_text())["output_ids"]] == cold_answers(
                top / "work" / "models" / name, [list(DEFAULT_PROMPT)], max_new
            ), name
        _assert_nothing_left(slurm_cluster, list(report["job_ids"].values()), top)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _assert_nothing_left(cluster: SlurmCluster, job_ids: list[str], top: Path) -> None:
    """As root: no image of the jobs, no process of theirs (a kept tree would be one)."""
    from spswap.checkpoint.service import images_of_job, temp_dirs
    from spswap.config import Config

    images = Config.from_env({}, root=cluster.spswap_root).paths.images
    # cancelled while held in the queue, the jobs run no epilog here: spswapd's sweep
    # (every 5 s on this cluster) frees their images and kept trees, and the bench waits
    # for it before it says "nothing left" (it once said so while the kept trees lived
    # on for up to a sweep's interval): only the moments a kill and a removal take
    wait_for("the images of the cancelled jobs to go", lambda: not [
        p for j in job_ids for p in images_of_job(images, j) + temp_dirs(images, j)],
        timeout_s=3)  # fmt: skip
    wait_for(
        "no process of the jobs (a kept tree is one)",
        lambda: subprocess.run(["pgrep", "-f", str(top)], capture_output=True).returncode == 1,
        timeout_s=3,
    )


def test_a_wrong_partition_is_refused_before_any_model_is_written(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    # (it wrote 172 MB of models into ./spswap-turns-<time> first, and left them)
    proc = subprocess.run(
        [slurm_cluster.spswap_bin, "bench", "turns", "--partition", "nope", "--json"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    error = json.loads(proc.stdout)["error"]
    assert error["message"].startswith("no partition 'nope' (sinfo lists ")
    assert error["message"].endswith("); pass --partition NAME")
    assert list(tmp_path.iterdir()) == []
