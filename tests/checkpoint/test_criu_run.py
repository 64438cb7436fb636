"""Running CRIU (spswap.checkpoint.criu_run): its output and exit code, its timeout, and
the watch that ends a dump whose process was killed under it. The runs are real
processes; the one thing that stands in for CRIU is a command that would wait as long
as CRIU was once seen to (a CRIU hanging on a killed process cannot be made on demand);
the killed process is real: a zombie, or a task frozen by a cgroup v1 freezer with its
SIGKILL pending, as CI's hybrid hosts hold one during a dump."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

import pytest

from spswap.checkpoint.criu_log import hint_for
from spswap.checkpoint.criu_run import DyingWatch, dying, run_criu

V1_FREEZER = Path("/sys/fs/cgroup/freezer")


def test_dying_reads_pending_kills_and_zombies() -> None:
    status = "Name:\tpython\nState:\tS (sleeping)\nSigPnd:\t{}\nShdPnd:\t{}\n"
    assert dying(status.format("0000000000000000", "0000000000000000")) is None
    assert dying(status.format("0000000000000000", "0000000000000100")) == "a SIGKILL is pending"
    assert dying(status.format("0000000000000100", "0000000000000000")) == "a SIGKILL is pending"
    assert dying(status.format("0000000000000200", "0000000000004002")) is None  # SIGUSR1...
    assert dying("State:\tZ (zombie)\n") == "it has exited (a zombie)"
    assert dying("State:\tX (dead)\n") == "it has exited (a zombie)"
    assert dying("SigPnd:\tzz\n") is None


def test_the_watch_gives_up_only_after_its_grace(tmp_path: Path) -> None:
    now = [100.0]
    status = tmp_path / "42" / "status"
    status.parent.mkdir()
    watch = DyingWatch(42, grace_s=20, proc=tmp_path, clock=lambda: now[0])
    status.write_text("State:\tS (sleeping)\nShdPnd:\t0000000000000100\n")
    assert watch() is None
    now[0] = 119.9
    assert watch() is None
    status.write_text("State:\tS (sleeping)\nShdPnd:\t0000000000000000\n")
    now[0] = 125.0
    assert watch() is None  # a signal that went: the count starts again
    status.write_text("State:\tZ (zombie)\n")
    assert watch() is None
    now[0] = 145.0
    assert watch() == ("the process being dumped (pid 42) was killed during the dump: it has "
                       "exited (a zombie) for 20 s, so CRIU was ended")  # fmt: skip
    status.unlink()
    gone = DyingWatch(42, grace_s=0, proc=tmp_path, clock=lambda: now[0])
    assert gone() == ("the process being dumped (pid 42) was killed during the dump: it is "
                      "gone for 0 s, so CRIU was ended")  # fmt: skip


def test_run_gives_the_exit_code_and_output() -> None:
    assert run_criu(["/bin/sh", "-c", "echo out; echo err >&2; exit 3"], 10) == (3, "out\nerr\n")


def test_run_ends_a_command_past_its_timeout() -> None:
    t0 = time.monotonic()
    rc, out = run_criu(["/bin/sh", "-c", "echo started; exec sleep 60"], 1.0)
    assert rc == -1 and out == "started\n\nspswap: criu did not finish within 1.0 s\n"
    assert time.monotonic() - t0 < 10
    assert hint_for(out) == "criu did not finish within 1.0 s"


def test_run_ends_when_the_dumped_process_is_a_zombie() -> None:
    victim = subprocess.Popen(["true"])
    try:
        while dying(Path(f"/proc/{victim.pid}/status").read_text()) is None:
            time.sleep(0.01)
        t0 = time.monotonic()
        rc, out = run_criu(["sleep", "600"], 600, give_up=DyingWatch(victim.pid, grace_s=1))
        assert rc == -1 and out.endswith(
            f"spswap: the process being dumped (pid {victim.pid}) was killed during the dump: "
            "it has exited (a zombie) for 1 s, so CRIU was ended\n")  # fmt: skip
        assert 1 <= time.monotonic() - t0 < 10
    finally:
        victim.wait()


@pytest.mark.skipif(os.geteuid() != 0 or not (V1_FREEZER / "cgroup.procs").exists(),
                    reason="needs root and a cgroup v1 freezer (hybrid hosts)")  # fmt: skip
def test_run_ends_when_the_dumped_process_is_killed_while_frozen() -> None:
    group = V1_FREEZER / f"spswap-test-frozen-{secrets.token_hex(4)}"
    group.mkdir()
    victim = subprocess.Popen(["sleep", "600"])
    try:
        (group / "cgroup.procs").write_text(str(victim.pid))
        (group / "freezer.state").write_text("FROZEN")
        while (group / "freezer.state").read_text().strip() != "FROZEN":
            time.sleep(0.01)
        os.kill(victim.pid, signal.SIGKILL)
        status = Path(f"/proc/{victim.pid}/status").read_text()
        assert dying(status) == "a SIGKILL is pending", status  # and it lives on, frozen
        rc, out = run_criu(["sleep", "600"], 600, give_up=DyingWatch(victim.pid, grace_s=1))
        assert rc == -1 and "a SIGKILL is pending for 1 s, so CRIU was ended" in out
    finally:
        (group / "freezer.state").write_text("THAWED")
        victim.kill()
        victim.wait(timeout=30)
        group.rmdir()


def test_run_ends_a_command_stopped_for_five_seconds_in_all() -> None:
    """CRIU runs as the job's user, who may SIGSTOP it: stopped, it held the lock every
    dump and restore of a tree with named semaphores takes, for its whole timeout."""
    import threading

    from spswap.checkpoint.proctree import children

    pids: list[int] = []

    def stop_it_now_and_then() -> None:
        deadline = time.monotonic() + 10
        while not pids and time.monotonic() < deadline:  # the run's child, once started
            pids.extend(p for p in children(os.getpid())
                        if Path(f"/proc/{p}/comm").read_text().strip() == "sleep")  # fmt: skip
            time.sleep(0.01)
        try:  # stopped 1.5 s of every 2 s, until the run ends it: only the sum can catch it
            while time.monotonic() < deadline + 30:
                os.kill(pids[0], signal.SIGSTOP)
                time.sleep(1.5)
                os.kill(pids[0], signal.SIGCONT)
                time.sleep(0.5)
        except ProcessLookupError:  # ended by the run: what the test wants
            pass

    stopper = threading.Thread(target=stop_it_now_and_then, daemon=True)
    stopper.start()
    t0 = time.monotonic()
    rc, out = run_criu(["sleep", "60"], 60)
    stopper.join(10)
    assert rc == -1 and f"spswap: criu (pid {pids[0]}) was stopped by a signal for 5 s in all" \
        in out, out  # fmt: skip
    assert time.monotonic() - t0 < 20
    assert hint_for(out).startswith(f"criu (pid {pids[0]}) was stopped by a signal")
