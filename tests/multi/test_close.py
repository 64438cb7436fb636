"""The end of a multi-model job's engines: every engine process is asked to close before
any is waited for (a stop waits for the slowest, not for their sum: Slurm's KillWait
leaves the whole job a few seconds), each ends, one that does not end in time is killed,
and one still waiting for its turn to load ends without loading."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from spswap.multi.procs import ModelProc, ModelSpec, close_all


class _Recorded:
    """Stands in for a ModelProc where only the order of the calls is asked."""

    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def ask_close(self) -> None:
        self.calls.append(f"ask {self.name}")

    def close(self, timeout_s: float = 10.0) -> None:
        self.calls.append(f"wait {self.name}")


def _procs(tmp_path: Path, n: int, **kw: object) -> list[ModelProc]:
    pytest.importorskip("torch")  # (the reference engine's processes)
    from tests.helpers.multi import make_models

    return [ModelProc(ModelSpec(m.name, m, ""), engine="reference", device="cpu",
                      root=tmp_path / "root", cold=True, **kw)  # type: ignore[arg-type]
            for m in make_models(tmp_path, n)]  # fmt: skip


def test_every_engine_is_asked_before_any_is_waited_for() -> None:
    calls: list[str] = []
    close_all([_Recorded(n, calls) for n in ("a", "b", "c")], 5.0)  # type: ignore[misc]
    assert calls == ["ask a", "ask b", "ask c", "wait a", "wait b", "wait c"]


def test_real_engine_processes_all_end(tmp_path: Path) -> None:
    procs = _procs(tmp_path, 3)
    for proc in procs:
        proc.wait_ready()
    close_all(procs, 30.0)
    # each ended on its own, after its close (a kill would give -9)
    assert [proc._proc.returncode for proc in procs] == [0, 0, 0]


def test_an_engine_that_does_not_end_in_time_is_killed(tmp_path: Path) -> None:
    (proc,) = _procs(tmp_path, 1)
    proc.wait_ready()
    # a process that ignores the close (its stdin) stands beside the real one, after it
    deaf = ModelProc.__new__(ModelProc)
    deaf.spec = ModelSpec("deaf", proc.spec.path, "")
    deaf._lock = proc._lock
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    deaf._proc = subprocess.Popen(sleeper, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)  # fmt: skip
    close_all([proc, deaf], 5.0)
    assert proc._proc.returncode == 0
    assert deaf._proc.returncode == -9


def test_an_engine_waiting_for_its_turn_ends_at_a_close_without_loading(
    tmp_path: Path,
) -> None:
    """A failed or stopped one-at-a-time start closes every engine process: one still
    waiting for its go took the close for its go and loaded its model first."""
    (proc,) = _procs(tmp_path, 1, wait_go=True)
    proc.ask_close()
    assert proc._proc.wait(60) == 0
    # it wrote nothing: no hello, so it never loaded
    assert proc._proc.stdout is not None and proc._proc.stdout.read() == ""


def test_a_ctrl_c_at_the_terminal_leaves_the_engines_to_the_router(tmp_path: Path) -> None:
    """A Ctrl-C reaches every process of the job's group: the router stops the job and
    closes its engines. An engine process that died of the SIGINT itself (a
    KeyboardInterrupt while loading, or in its loop) printed a traceback and read as a
    failed model; it goes on until the router closes it."""
    import os
    import signal
    import time

    def ignores_sigint(pid: int) -> bool:
        status = Path(f"/proc/{pid}/status").read_text()
        mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn"))
        return bool(int(mask, 16) & (1 << (signal.SIGINT - 1)))

    (proc,) = _procs(tmp_path, 1)
    # the terminal's SIGINT goes to the router's process group: each engine process
    # leads a session of its own (vLLM's own processes with it), outside that group
    assert os.getsid(proc.pid) == proc.pid and os.getpgid(proc.pid) != os.getpgid(0)
    # the worker ignores it from its first statement on (before it imports torch); a
    # Ctrl-C in the interpreter's own start, a few tenths of a second, still ends it
    deadline = time.monotonic() + 30
    while not ignores_sigint(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGINT)  # while it loads (torch, the model)
    proc.wait_ready()
    os.kill(proc.pid, signal.SIGINT)  # while it waits for requests
    assert proc.call("health")["ok"]
    close_all([proc], 30.0)
    assert proc._proc.returncode == 0
