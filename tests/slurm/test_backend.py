"""Backend unit tests: pyslurm calls pinned on an injected module (no pyslurm matches
Slurm 22.05 here), CLI argv and failure handling with recording executables on PATH.
The CLI backend against a real slurmctld is in test_integration.py."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from spswap.errors import SlurmCommandError
from spswap.slurm.backend import (
    CliBackend,
    PyslurmBackend,
    SlurmBackend,
    get_backend,
    parse_version,
    signal_name,
    slurm_env,
)
from spswap.slurm.parse import JobInfo

FIXTURES = Path(__file__).parent.parent / "fixtures" / "slurm"


@pytest.mark.parametrize(
    ("given", "name"),
    [("USR1", "USR1"), ("SIGUSR1", "USR1"), ("usr1", "USR1"), (10, "USR1"), ("15", "TERM"),
     ("sigterm", "TERM")],
)  # fmt: skip
def test_signal_name(given: str | int, name: str) -> None:
    assert signal_name(given) == name


@pytest.mark.parametrize("bad", ["USR9", "", "SIG", 999, "1; rm -rf /"])
def test_signal_name_rejects(bad: str | int) -> None:
    with pytest.raises(ValueError, match="unknown signal"):
        signal_name(bad)


@pytest.mark.parametrize(
    ("text", "version"),
    [("slurm 22.05.8\n", (22, 5)), ("22.5.1", (22, 5)), ("slurm-wlm 24.11.1", (24, 11)),
     ("25.11.2", (25, 11)), ("", None), ("unknown", None)],
)  # fmt: skip
def test_parse_version(text: str, version: tuple[int, int] | None) -> None:
    assert parse_version(text) == version


# ---------------------------------------------------------------- pyslurm, pinned calls
class FakeRPCError(Exception):
    def __init__(self, msg: str, errno: int) -> None:
        super().__init__(msg)
        self.errno = errno


class FakePyslurm:
    """Records the pyslurm 22.5 API calls the backend makes; answers like pyslurm."""

    __version__ = "22.5.1"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.known = {
            7: SimpleNamespace(id=7, state="RUNNING", requeue_count=1, user_id=1000,
                               partition="low", state_reason="None", comment="m",
                               eligible_time=1796351608),
        }  # fmt: skip
        fake = self

        class Job:
            def __init__(self, job_id: int) -> None:
                fake.calls.append(("Job", job_id))
                self.id = job_id

            @staticmethod
            def load(job_id: int) -> Any:
                fake.calls.append(("Job.load", job_id))
                if job_id not in fake.known:
                    raise FakeRPCError("Invalid job id specified", 2017)
                return fake.known[job_id]

            def requeue(self) -> None:
                fake.calls.append(("requeue", self.id))

            def send_signal(self, signal: int, steps: str = "children") -> None:
                fake.calls.append(("send_signal", self.id, signal, steps))

            def cancel(self) -> None:
                fake.calls.append(("cancel", self.id))

        class Jobs:
            @staticmethod
            def load() -> dict[int, Any]:
                fake.calls.append(("Jobs.load",))
                return dict(fake.known)

        self.Job = Job
        self.Jobs = Jobs


@pytest.mark.parametrize(
    ("module_version", "slurm", "matches"),
    [("22.5.1", (22, 5), True), ("25.11.2", (22, 5), False), ("22.5.0", (23, 2), False),
     ("", (22, 5), False), ("22.5.1", None, False)],
)  # fmt: skip
def test_pyslurm_used_only_when_versions_match(
    module_version: str, slurm: tuple[int, int] | None, matches: bool
) -> None:
    module = SimpleNamespace(__version__=module_version)
    assert (PyslurmBackend.if_matching(module, slurm) is not None) is matches


def test_pyslurm_job() -> None:
    fake = FakePyslurm()
    backend = PyslurmBackend(fake)
    assert isinstance(backend, SlurmBackend)
    assert backend.job("7") == JobInfo(
        job_id="7", state="RUNNING", restart_count=1, uid=1000, partition="low",
        reason="None", comment="m", eligible_s=1796351608.0,
    )  # fmt: skip
    assert backend.job("8") is None
    assert backend.job_alive("7") is True
    assert backend.job_alive("8") is False
    assert fake.calls == [("Job.load", 7), ("Job.load", 8), ("Job.load", 7), ("Job.load", 8)]


def test_pyslurm_actions() -> None:
    fake = FakePyslurm()
    backend = PyslurmBackend(fake)
    backend.requeue("7")
    backend.signal_batch("7", "USR1")
    backend.signal_batch("7", "SIGTERM")
    backend.cancel("7")
    assert fake.calls == [
        ("Job", 7), ("requeue", 7),
        ("Job", 7), ("send_signal", 7, 10, "batch"),
        ("Job", 7), ("send_signal", 7, 15, "batch"),
        ("Job", 7), ("cancel", 7),
    ]  # fmt: skip
    assert [j.job_id for j in backend.jobs()] == ["7"]


def test_pyslurm_errors_become_slurm_command_errors() -> None:
    fake = FakePyslurm()

    def unreachable(job_id: int) -> Any:
        raise FakeRPCError("Unable to contact slurm controller (connect failure)", 1001)

    fake.Job.load = staticmethod(unreachable)  # type: ignore[method-assign]
    backend = PyslurmBackend(fake)
    with pytest.raises(SlurmCommandError, match="Unable to contact"):
        backend.job("7")
    assert backend.job_alive("7") is None  # cannot tell: never reclaim
    with pytest.raises(SlurmCommandError, match="numeric job ids"):
        backend.requeue("12_3")


# ---------------------------------------------------------------- CLI, argv and failures
def _shim(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f'#!/bin/sh\necho "$0 $*" >> {bin_dir}/calls\n{body}\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def shim_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return bin_dir


def _calls(bin_dir: Path) -> list[str]:
    return [line.split(" ", 1)[1] for line in (bin_dir / "calls").read_text().splitlines()]


def test_cli_argv(shim_path: Path) -> None:
    fixture = FIXTURES / "scontrol_show_job_multiline_forged_name.txt"
    _shim(shim_path, "scontrol", f'[ "$1" = show ] && cat {fixture}; exit 0')
    _shim(shim_path, "scancel", "exit 0")
    _shim(shim_path, "squeue", f"cat {FIXTURES / 'squeue_two_gpus.json'}")
    backend = CliBackend()
    assert backend.available()
    info = backend.job("8")
    assert info is not None and (info.state, info.gpus) == ("RUNNING", (0,))
    backend.requeue("8")
    backend.signal_batch("8", "SIGUSR1")
    backend.cancel("8")
    assert [j.job_id for j in backend.jobs()] == ["1", "2", "3", "4", "5"]
    assert _calls(shim_path) == [
        "show job -d 8",
        "requeue 8",
        "--batch --signal=USR1 8",
        "8",
        "--json",
    ]


def test_cli_unknown_job_is_none(shim_path: Path) -> None:
    _shim(shim_path, "scontrol",
          "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1")  # fmt: skip
    assert CliBackend().job("99") is None
    assert CliBackend().job_alive("99") is False


def test_cli_failure_carries_argv_and_output(shim_path: Path) -> None:
    _shim(shim_path, "scontrol",
          "echo 'slurm_load_jobs error: Unable to contact slurm controller (connect failure)' >&2;"
          " exit 1")  # fmt: skip
    with pytest.raises(SlurmCommandError) as info:
        CliBackend().job("5")
    assert info.value.argv == ["scontrol", "show", "job", "-d", "5"]
    assert "Unable to contact" in info.value.output
    assert "scontrol ping" in str(info.value)
    assert CliBackend().job_alive("5") is None


def test_cli_timeout(shim_path: Path) -> None:
    _shim(shim_path, "scontrol", "exec sleep 5")
    with pytest.raises(SlurmCommandError, match="did not answer within 0.2 s"):
        CliBackend(timeout_s=0.2).job("5")
    assert CliBackend(timeout_s=0.2).job_alive("5") is None


def test_cli_garbage_output(shim_path: Path) -> None:
    _shim(shim_path, "scontrol", "echo hello")
    _shim(shim_path, "squeue", "echo '{'")
    with pytest.raises(SlurmCommandError, match="cannot read the output"):
        CliBackend().job("5")
    with pytest.raises(SlurmCommandError, match="squeue --json"):
        CliBackend().jobs()


def test_no_slurm_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert not CliBackend().available()
    assert get_backend() is None
    with pytest.raises(SlurmCommandError, match="slurm-client"):
        CliBackend().cancel("1")
    assert CliBackend().job_alive("1") is None


def test_get_backend_is_cli_without_pyslurm(shim_path: Path) -> None:
    for name in ("scontrol", "squeue", "scancel"):
        _shim(shim_path, name, "echo 'slurm 22.05.8'")
    backend = get_backend()
    assert backend is not None and backend.name == "cli"
    assert os.environ["PATH"].startswith(str(shim_path))


def test_slurm_commands_print_times_in_the_form_spswap_reads() -> None:
    mine = {"PATH": "/usr/bin", "SLURM_TIME_FORMAT": "relative"}
    assert slurm_env(mine) == {"PATH": "/usr/bin", "SLURM_TIME_FORMAT": "standard"}
    assert mine["SLURM_TIME_FORMAT"] == "relative"  # the caller's own is left as it was
