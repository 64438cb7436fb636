"""A user cannot hold CRIU stopped: spswap's CRIU runs as the job's user (setpriv, with
CRIU's capabilities ambient), who may signal it, and a stopped CRIU held the lock that
every dump and restore of a tree with named semaphores takes (other users' jobs waited,
their restores gave up) until CRIU's timeout. Stopped for 5 s in all, it is ended.

Here the command after spswap's own setpriv prefix is ``sleep`` (a CRIU cannot be made
to stand still on demand otherwise); the stop comes from the second uid, as a real
user's would. Before the watch, the run waited its whole timeout.
"""

from __future__ import annotations

import os
import signal
import time

from spswap.checkpoint.criu_run import run_criu
from spswap.checkpoint.criu_user import RunAs
from spswap.checkpoint.proctree import children
from tests.uids import spawn_as


def _stop_repeatedly(pid: int) -> str:
    deadline = time.monotonic() + 25  # past the run's 30 s timeout less its start
    try:
        while time.monotonic() < deadline:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(1.5)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.3)
    except ProcessLookupError:
        return "ended"
    except PermissionError as e:
        return f"PermissionError: {e}"
    return "ran on"


def test_a_user_cannot_hold_their_criu_stopped(user_uid: int) -> None:
    import threading

    found: list[int] = []
    result: list[str] = []

    def stop_as_user() -> None:
        deadline = time.monotonic() + 10
        while not found and time.monotonic() < deadline:
            found.extend(p for p in children(os.getpid())
                         if open(f"/proc/{p}/comm").read().strip() == "sleep")  # fmt: skip
            time.sleep(0.01)
        result.append(spawn_as(user_uid, _stop_repeatedly, found[0]).result())

    stopper = threading.Thread(target=stop_as_user, daemon=True)
    stopper.start()
    t0 = time.monotonic()
    rc, out = run_criu(RunAs.for_uid(user_uid).prefix() + ["sleep", "40"], 30.0)
    took_s = time.monotonic() - t0
    stopper.join(40)
    assert result == ["ended"], result  # the user could signal it: it ran as them
    assert rc == -1 and "was stopped by a signal for 5 s in all" in out, out
    assert took_s < 15, took_s
