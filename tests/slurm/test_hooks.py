"""slurm/prolog.sh and slurm/epilog.sh run directly, as slurmd runs them: as root-ish,
with an empty environment except Slurm's variables. They must always exit 0, print
nothing (slurmd reads their output until EOF), and log what happened."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HOOKS = ["prolog", "epilog"]


@contextlib.contextmanager
def _var_log_as_it_was() -> Iterator[None]:
    """The hooks' fallback logs in /var/log (the node's real ones) cut back to their size
    before the test: an admin who runs the tests on a node finds no test lines there."""
    sizes = {p: p.stat().st_size if p.exists() else None
             for p in (Path(f"/var/log/spswap-{a}.log") for a in HOOKS)}  # fmt: skip
    try:
        yield
    finally:
        for path, size in sizes.items():
            with contextlib.suppress(OSError):
                if size is None:
                    path.unlink(missing_ok=True)
                else:
                    os.truncate(path, size)


def _run_hook(
    action: str, tmp_path: Path, bin_body: str | None, extra: str = ""
) -> tuple[subprocess.CompletedProcess[str], str, float]:
    root = tmp_path / "root"
    defaults = tmp_path / "defaults"
    lines = [f"SPSWAP_ROOT={root}"]
    if bin_body is not None:
        spswap = tmp_path / "spswap"
        spswap.write_text("#!/bin/bash\n" + bin_body + "\n")
        spswap.chmod(0o755)
        lines.append(f"SPSWAP_BIN={spswap}")
    else:
        lines.append(f"SPSWAP_BIN={tmp_path / 'missing' / 'spswap'}")
    defaults.write_text("\n".join(lines) + "\n" + extra)
    env = {"SPSWAP_DEFAULTS": str(defaults), "SLURM_JOB_ID": "41", "SLURM_JOB_GPUS": "1"}
    start = time.monotonic()
    proc = subprocess.run(
        [str(REPO / "slurm" / f"{action}.sh")], env=env, capture_output=True, text=True,
        timeout=30,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    log_path = root / "log" / f"{action}.log"
    log = log_path.read_text() if log_path.exists() else ""
    return proc, log, elapsed


@pytest.mark.parametrize("action", HOOKS)
def test_success_runs_spswap_node_action_with_the_job_environment(
    action: str, tmp_path: Path
) -> None:
    body = f'echo "args=$* job=$SLURM_JOB_ID gpus=$SLURM_JOB_GPUS path=$PATH" > {tmp_path}/seen'
    proc, log, _ = _run_hook(action, tmp_path, body)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    seen = (tmp_path / "seen").read_text()
    assert seen.startswith(f"args=node {action} job=41 gpus=1 path=/usr/local/sbin:")
    assert f"job=41 {action}: ok" in log


@pytest.mark.parametrize("action", HOOKS)
def test_missing_spswap_exits_0_and_logs(action: str, tmp_path: Path) -> None:
    """Where the root is there (spswap set up, its executable not found), the line goes
    to the root's log, naming both fixes."""
    (tmp_path / "root").mkdir(mode=0o755)
    proc, log, _ = _run_hook(action, tmp_path, None)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    assert (
        f"job=41 {action}: spswap executable not found (SPSWAP_BIN='{tmp_path}/missing/spswap'"
        "): skipped, the job runs without spswap. Set SPSWAP_BIN in "
        f"{tmp_path}/defaults; where spswap was taken off this node on purpose this line is "
        "expected (off every node: take Prolog= and Epilog= out of slurm.conf; "
        "docs/slurm.md, Removing spswap)"
    ) in log, log


@pytest.mark.parametrize("action", HOOKS)
def test_on_a_node_spswap_was_taken_off_the_hooks_make_no_root(action: str, tmp_path: Path) -> None:
    """The admin walk: after "Removing spswap" (its root deleted) the next job's hooks made
    the root again, for their log line; now the line goes to /var/log."""
    if os.geteuid() != 0:
        pytest.skip("the hooks log to /var/log: root's, as slurmd runs them")
    var_log = Path(f"/var/log/spswap-{action}.log")
    with _var_log_as_it_was():
        before = var_log.stat().st_size if var_log.exists() else 0
        proc, _log, _ = _run_hook(action, tmp_path, None)
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
        assert not (tmp_path / "root").exists()
        with var_log.open() as f:
            f.seek(before)
            assert f"job=41 {action}: spswap executable not found" in f.read()


@pytest.mark.parametrize("action", HOOKS)
def test_failing_spswap_exits_0_and_logs(action: str, tmp_path: Path) -> None:
    proc, log, _ = _run_hook(action, tmp_path, "echo 'daemon socket refused' >&2; exit 3")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    assert "daemon socket refused" in log
    assert f"FAILED: '{tmp_path}/spswap node {action}' exited 3; node left in service" in log


def test_hanging_spswap_is_killed_after_the_timeout(tmp_path: Path) -> None:
    proc, log, elapsed = _run_hook("prolog", tmp_path, "sleep 60", "SPSWAP_HOOK_TIMEOUT_S=1\n")
    assert proc.returncode == 0
    assert elapsed < 10
    assert "took more than 1s (killed)" in log


def test_a_child_left_running_does_not_hold_the_hook_output(tmp_path: Path) -> None:
    # slurmd waits for EOF on the prolog's stdout: a daemon that inherited it would hang
    # the job in "RUNNING Prolog". The wrapper sends everything to the log file instead.
    body = f"sleep 30 & echo $! > {tmp_path}/child; exit 0"
    proc, log, elapsed = _run_hook("prolog", tmp_path, body)
    child = int((tmp_path / "child").read_text())
    try:
        assert proc.returncode == 0
        assert elapsed < 10
        assert "prolog: ok" in log
    finally:
        os.kill(child, signal.SIGKILL)


def _prolog_with_root(tmp_path: Path, root: Path) -> subprocess.CompletedProcess[str]:
    """prolog.sh with SPSWAP_ROOT=``root`` and no spswap to run."""
    defaults = tmp_path / "defaults"
    defaults.write_text(f"SPSWAP_ROOT={root}\nSPSWAP_BIN={tmp_path}/none\n")
    with _var_log_as_it_was():  # (its line goes there)
        return subprocess.run(
            [str(REPO / "slurm" / "prolog.sh")], env={"SPSWAP_DEFAULTS": str(defaults)},
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip


def test_unwritable_root_falls_back_without_failing(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = _prolog_with_root(tmp_path, blocker / "root")
    assert (proc.returncode, proc.stdout) == (0, "")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a root owned by another uid")
def test_a_root_another_user_made_gets_no_log_from_root(tmp_path: Path) -> None:
    """On /dev/shm any user can make the root (and a symlink for the log) before the
    first prolog: the hooks, run as root, then log elsewhere and touch nothing there."""
    from spswap.node import FALLBACK_LOG_DIR, log_dir_for

    target = tmp_path / "target"
    target.write_text("")
    foreign = tmp_path / "foreign"
    (foreign / "log").mkdir(parents=True)
    (foreign / "log" / "prolog.log").symlink_to(target)
    os.chown(foreign / "log", 65534, 65534)
    os.chown(foreign, 65534, 65534)
    linked = tmp_path / "linked"
    linked.symlink_to(tmp_path / "mine", target_is_directory=True)
    (tmp_path / "mine").mkdir()
    assert log_dir_for(foreign) == log_dir_for(linked) == FALLBACK_LOG_DIR
    assert log_dir_for(tmp_path / "fresh") == tmp_path / "fresh" / "log"  # made, root's
    assert (tmp_path / "fresh" / "log").is_dir()
    for root in (foreign, linked):
        proc = _prolog_with_root(tmp_path, root)
        assert (proc.returncode, proc.stdout) == (0, "")
    assert target.read_text() == "" and not (tmp_path / "mine" / "log").exists()
