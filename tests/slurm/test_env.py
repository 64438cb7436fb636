# ruff: noqa: E501  (tables of real outputs read best one row per line)
"""JobEnv from environments: tables, plus the environments captured from a real Slurm."""

from __future__ import annotations

from pathlib import Path

import pytest

from spswap.slurm.env import ENV_VARS, JobEnv, parse_gpu_list

FIXTURES = Path(__file__).parent.parent / "fixtures" / "slurm"


def _read_env(name: str) -> dict[str, str]:
    lines = (FIXTURES / name).read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"CUDA_VISIBLE_DEVICES": "0"}, None),
        ({"SLURM_JOB_ID": ""}, None),
        ({"SLURM_JOB_ID": "7"}, JobEnv(job_id="7")),
        ({"SLURM_JOBID": "7"}, JobEnv(job_id="7")),
        ({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "2"}, JobEnv(job_id="7", restart_count=2)),
        ({"SLURM_JOB_ID": "7", "SLURM_JOB_RESTART_COUNT": "1"}, JobEnv(job_id="7", restart_count=1)),
        ({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "x"}, JobEnv(job_id="7")),
        ({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "-3"}, JobEnv(job_id="7")),
        ({"SLURM_JOB_ID": "7", "SLURM_JOB_GPUS": "1,3", "CUDA_VISIBLE_DEVICES": "0,1"},
         JobEnv(job_id="7", gpus=(1, 3))),
        ({"SLURM_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": "0,1"}, JobEnv(job_id="7", gpus=(0, 1))),
        ({"SLURM_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": "GPU-5e1c,GPU-aa"}, JobEnv(job_id="7")),
        ({"SLURM_JOB_ID": "7", "SLURM_JOB_UID": "1000", "SLURM_JOB_USER": "ann"},
         JobEnv(job_id="7", uid=1000, user="ann")),
        ({"SLURM_JOB_ID": "7", "SLURM_JOB_UID": "root"}, JobEnv(job_id="7")),
        ({"SLURM_JOB_ID": "7", "SLURM_JOB_COMMENT": "model: a b", "SLURMD_NODENAME": "n1",
          "SLURM_JOB_PARTITION": "low"},
         JobEnv(job_id="7", comment="model: a b", node="n1", partition="low")),
        # captured from a real 22.05 job with --gres=shard:2 (4 shards per GPU)
        ({"SLURM_JOB_ID": "7", "SLURM_JOB_GPUS": "0", "CUDA_VISIBLE_DEVICES": "0",
          "SLURM_SHARDS_ON_NODE": "2"}, JobEnv(job_id="7", gpus=(0,), shards=2)),
    ],
)  # fmt: skip
def test_from_env_table(env: dict[str, str], expected: JobEnv | None) -> None:
    assert JobEnv.from_env(env) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [(None, ()), ("", ()), ("0", (0,)), ("0,1, 3", (0, 1, 3)), ("0,,2", (0, 2)),
     ("0,GPU-x", ()), ("MIG-1/2/3", ()), ("-1", ())],
)  # fmt: skip
def test_parse_gpu_list(text: str | None, expected: tuple[int, ...]) -> None:
    assert parse_gpu_list(text) == expected


# Environments captured from a real Slurm 22.05 (scripts/slurm_up.sh, 2 fake GPUs):
# one job (id 3, partition low, --comment=model:qwen, --gres=gpu:1), requeued once.
@pytest.mark.parametrize(
    ("fixture", "restart_count", "comment"),
    [
        ("job_env_first_run.txt", 0, None),
        ("job_env_after_requeue.txt", 1, None),
        ("prolog_env_first_run.txt", 0, "model:qwen"),
        ("prolog_env_after_requeue.txt", 1, "model:qwen"),
        ("epilog_env_after_requeue.txt", 1, "model:qwen"),
    ],
)
def test_from_real_environments(fixture: str, restart_count: int, comment: str | None) -> None:
    env = JobEnv.from_env(_read_env(fixture))
    assert env == JobEnv(
        job_id="3", restart_count=restart_count, gpus=(0,), uid=0, user="root",
        comment=comment, node="vm", partition="low",
    )  # fmt: skip
    assert env.is_restart == (restart_count > 0)


def test_first_run_of_a_job_has_no_restart_variable() -> None:
    # why ENV_VARS lists two names: the job sees SLURM_RESTART_COUNT only after a requeue,
    # the prolog always sees SLURM_JOB_RESTART_COUNT
    assert "SLURM_RESTART_COUNT" not in _read_env("job_env_first_run.txt")
    assert _read_env("prolog_env_first_run.txt")["SLURM_JOB_RESTART_COUNT"] == "0"
    assert set(ENV_VARS["restart_count"]) == {"SLURM_RESTART_COUNT", "SLURM_JOB_RESTART_COUNT"}


def test_from_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_JOB_GPUS", "1")
    assert JobEnv.from_env() == JobEnv(job_id="42", gpus=(1,))
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    assert JobEnv.from_env() is None
