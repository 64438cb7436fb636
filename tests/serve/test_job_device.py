"""A job's device is chosen once, by its first run, and remembered in its state directory:
a requeued run restores by the same identity without importing torch to ask again."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from spswap.cli import serve_slurm as serve_cli


def test_the_first_run_chooses_and_later_runs_read_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    monkeypatch.setattr(serve_cli, "default_device", lambda: "cuda")
    assert serve_cli.job_device(state) == "cuda"
    assert (state / serve_cli.DEVICE_FILE).read_text() == "cuda\n"
    assert (state / serve_cli.DEVICE_FILE).stat().st_mode & 0o777 == 0o600

    def no_torch() -> str:
        raise AssertionError("a later run asked torch again")

    monkeypatch.setattr(serve_cli, "default_device", no_torch)
    assert serve_cli.job_device(state) == "cuda"


def test_a_damaged_record_is_chosen_again(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / serve_cli.DEVICE_FILE).write_text("tpu\n")
    monkeypatch.setattr(serve_cli, "default_device", lambda: "cpu")
    assert serve_cli.job_device(state) == "cpu"
    assert (state / serve_cli.DEVICE_FILE).read_text() == "cpu\n"


def test_with_slurms_controller_down_the_start_asks_it_nothing_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the controller down, `scontrol ping` says so at once while every other Slurm
    command retries its connection for seconds (9 s for `show config`, 18 s for `show
    job` on the CI machine): the start's requeue warning and KillWait are then not asked.
    (Slurm's commands are a stand-in here that logs its calls; with a controller up,
    tests/slurm's end-to-end tests get both.)"""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    for cmd in ("scontrol", "squeue", "sinfo", "sbatch", "scancel"):
        (bin_dir / cmd).write_text(
            f'#!/bin/sh\necho "{cmd} $*" >> {calls}\n'
            'if [ "$1" = ping ]; then echo "Slurmctld(primary) at vm is DOWN"; exit 1; fi\n'
            "sleep 30\n"
        )
        (bin_dir / cmd).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    state = tmp_path / "state"
    serve_cli.warn_if_not_requeueable("42", state)
    assert serve_cli.job_kill_wait_s(state) is None
    assert calls.read_text().splitlines() == ["scontrol ping", "scontrol ping"]
    assert not (state / serve_cli.KILL_WAIT_FILE).exists()  # asked again by the next run
    # `spswap serve` asks both through one cached answer: one ping per start
    calls.unlink()
    answers = functools.cache(serve_cli.controller_answers)
    serve_cli.warn_if_not_requeueable("42", state, answers)
    assert serve_cli.job_kill_wait_s(state, answers) is None
    assert calls.read_text().splitlines() == ["scontrol ping"]
