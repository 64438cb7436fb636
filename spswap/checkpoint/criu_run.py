"""Running the CRIU binary: its output, its timeout, and two watches. One on the process a
dump holds: once that process is dying (SIGKILL pending, a zombie, or gone) for some
seconds, the dump cannot give an image any more, so CRIU is ended instead of waiting for
its timeout. One on CRIU itself: it runs as the job's user, who may signal it, and a
CRIU stopped (SIGSTOP) would hold what it holds (the lock every dump and restore of a
tree with named semaphores takes) until its timeout; stopped for :data:`STOPPED_MAX_S`
in all, it is ended.

Why: a process killed while CRIU holds it can stay with its SIGKILL pending (a cgroup v1
freezer keeps a frozen task from dying until it is thawed, after CRIU), and CRIU was
seen waiting on it for its whole 600 s timeout; the job's checkpoint waited as long.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from spswap.errors import CriuNotStarted

PROC = Path("/proc")
WATCH_INTERVAL_S = 0.5
SIGKILL_BIT = 1 << (9 - 1)  # SIGKILL is signal 9; /proc's masks start at signal 1
DEFAULT_GRACE_S = 20.0
STOPPED_MAX_S = 5.0


def dying(status_text: str) -> str | None:
    """Why the process whose ``/proc/PID/status`` is ``status_text`` is dying, or None.

    >>> dying("State:\\tS (sleeping)\\nShdPnd:\\t0000000000000100\\nSigPnd:\\t0\\n")
    'a SIGKILL is pending'
    >>> dying("State:\\tZ (zombie)\\n")
    'it has exited (a zombie)'
    >>> dying("State:\\tS (sleeping)\\nShdPnd:\\t0000000000004000\\nSigPnd:\\t0\\n") is None
    True
    """
    for line in status_text.splitlines():
        key, _, value = line.partition(":")
        value = value.strip()
        if key == "State" and value.startswith(("Z", "X")):
            return "it has exited (a zombie)"
        if key in ("SigPnd", "ShdPnd"):
            try:
                if int(value, 16) & SIGKILL_BIT:
                    return "a SIGKILL is pending"
            except ValueError:
                continue
    return None


def stopped(status_text: str) -> bool:
    """Whether ``/proc/PID/status`` says the process is stopped by a signal.

    >>> stopped("State:\\tT (stopped)\\n"), stopped("State:\\tS (sleeping)\\n")
    (True, False)
    """
    return any(line.startswith("State:") and line.split(":", 1)[1].strip().startswith("T (")
               for line in status_text.splitlines())  # fmt: skip


def _stopped(pid: int, proc: Path = PROC) -> bool:
    try:
        return stopped((proc / str(pid) / "status").read_text())
    except OSError:
        return False


class DyingWatch:
    """Called now and then while CRIU runs: the reason to end CRIU once ``pid`` has been
    dying for ``grace_s`` (a kill that CRIU's own run outlasts is no reason), else None."""

    def __init__(self, pid: int, grace_s: float = DEFAULT_GRACE_S, proc: Path = PROC,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.pid = pid
        self.grace_s = grace_s
        self.proc = proc
        self.clock = clock
        self._since: float | None = None

    def __call__(self) -> str | None:
        try:
            why = dying((self.proc / str(self.pid) / "status").read_text())
        except FileNotFoundError:
            why = "it is gone"
        except OSError:
            why = None
        if why is None:
            self._since = None
            return None
        now = self.clock()
        if self._since is None:
            self._since = now
        if now - self._since < self.grace_s:
            return None
        return (f"the process being dumped (pid {self.pid}) was killed during the dump: "
                f"{why} for {self.grace_s:g} s, so CRIU was ended")  # fmt: skip


def run_criu(argv: list[str], timeout_s: float, pass_fds: list[int] | None = None,
             cgroup_dirs: list[Path] | None = None,
             give_up: Callable[[], str | None] | None = None,
             env: dict[str, str] | None = None) -> tuple[int, str]:  # fmt: skip
    """CRIU's exit code and output; -1 when it was ended: past ``timeout_s``, stopped for
    :data:`STOPPED_MAX_S` in all, or once ``give_up`` (asked every
    :data:`WATCH_INTERVAL_S`) gives a reason. ``env``: CRIU's environment (else this
    process's)."""

    def enter_cgroups() -> None:  # in the child, before the exec: CRIU starts there
        for d in cgroup_dirs or []:
            (d / "cgroup.procs").write_text("0")  # (0: the writing process itself)

    try:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            pass_fds=tuple(pass_fds or ()), preexec_fn=enter_cgroups if cgroup_dirs else None,
            env=env,
        )  # fmt: skip
    except subprocess.SubprocessError as e:  # Python's only word for a failed preexec_fn
        where = ", ".join(str(d) for d in cgroup_dirs or [])
        raise CriuNotStarted(f"CRIU could not be started inside the cgroup(s) {where} "
                             f"({e}): is each one there, and its cgroup.procs writable "
                             "by root?") from None  # fmt: skip
    except OSError as e:
        raise CriuNotStarted(f"CRIU could not be started ({argv[0]}: {e}): check it with "
                             "`spswap doctor`") from None  # fmt: skip
    deadline = time.monotonic() + timeout_s
    why = None
    stopped_s = 0.0
    last = time.monotonic()
    with proc:
        while why is None:
            try:
                out, _ = proc.communicate(timeout=min(WATCH_INTERVAL_S, timeout_s))
                return proc.returncode, out.decode(errors="replace")
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            # (the time since the last look: a slow look on a busy node counts in full)
            stopped_s += now - last if _stopped(proc.pid) else 0.0
            last = now
            if now >= deadline:
                why = f"criu did not finish within {timeout_s} s"
            elif stopped_s >= STOPPED_MAX_S:
                why = (f"criu (pid {proc.pid}) was stopped by a signal for {STOPPED_MAX_S:g} s "
                       "in all (it runs as the job's user, who may signal it), so it was "
                       "ended")  # fmt: skip
            elif give_up is not None:
                why = give_up()
        proc.kill()
        out, _ = proc.communicate()
    return -1, out.decode(errors="replace") + f"\nspswap: {why}\n"
