"""A job's device is chosen once, by its first run, and remembered in its state directory:
a requeued run restores by the same identity without importing torch to ask again."""

from __future__ import annotations

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
