"""What spswap shows of a CRIU run's log: its first error, its tail led by its first
errors, and a hint judged from its error lines; and where the log is kept."""

from __future__ import annotations

import re
from pathlib import Path

from spswap.checkpoint import proctree

LOG_TAIL_LINES = 15
# The harmless line CRIU logs on every run when it cannot raise its own fd limit.
NOISE = "Can't setup RLIMIT_NOFILE for self"


def log_tail(text: str, lines: int = LOG_TAIL_LINES, first_errors: int = 3) -> list[str]:
    """The last ``lines`` lines of a CRIU log, without the harmless RLIMIT line, led by
    its first ``first_errors`` error lines where the tail leaves them out: CRIU says what
    went wrong in its first error and then only unwinds ("Dumping FAILED"), and the whole
    log is root's alone."""
    kept = [line for line in text.splitlines() if line.strip() and NOISE not in line]
    tail = kept[-lines:]
    head = kept[: len(kept) - len(tail)]
    errors = [line for line in head if "Error (" in line][:first_errors]
    return [*errors, "..."] + tail if errors else tail


_ERROR_RE = re.compile(r"^(?:\(\s*[\d.]+\)\s*)?(?:\S+: )?Error \([^)]*\):\s*(.*)$")


def first_error(text: str) -> str | None:
    """CRIU's first error line, without its time stamp and source place ("Can't get
    rlimit 0: Operation not permitted"), the harmless RLIMIT line skipped: what went
    wrong; the errors after it only unwind. None when the log has no error line."""
    for line in text.splitlines():
        m = _ERROR_RE.match(line.strip())
        if m and NOISE not in line and m.group(1):
            return m.group(1).strip()
    return None


CAP_SYS_RESOURCE_FIX = (
    "root here lacks CAP_SYS_RESOURCE, which root's CRIU needs to read another user's "
    "limits: leave SPSWAP_CRIU_AS_ROOT unset so that CRIU runs as the job's user "
    "(--unprivileged), or give spswapd CAP_SYS_RESOURCE; spswap doctor test-dumps both ways"
)
OTHER_RIGHTS_FIX = (
    "CRIU, running as the job's user, may not read a process of the tree: one runs with "
    "other rights (a setuid or setgid program, or one with file capabilities); such a "
    "tree is never dumped: end that program before the checkpoint"
)


GHOST_FILE_FIX = (
    "a file the process maps was deleted while it ran (a pool entry removed with `spswap "
    "pool rm --force` while the job used it?), and CRIU carries deleted files only up to a "
    "small size: this run cannot be checkpointed; the job's next run starts anew (from the "
    "pool, or from the model's files where the entry is gone)"
)


OURS = "spswap: "  # a line spswap adds to CRIU's output (criu_run, criu_argv's guard)


def hint_for(log: str) -> str:
    """What to do about a failed CRIU run, judged from its log's error lines (a verbose
    log names sockets and io_urings in passing; only its errors say what failed)."""
    errors = "\n".join(line for line in log.splitlines() if "Error" in line or "rror:" in line)
    ours = [line.removeprefix(OURS) for line in log.splitlines() if line.startswith(OURS)]
    if ours:  # spswap ended CRIU, or CRIU never started: that is the reason
        return ours[-1]
    if "No space left on device" in log:
        return (
            "the image's file system is full: free space (remove old images) or give the "
            "tmpfs more room; the process was resumed and keeps running"
        )
    if "Can't get rlimit" in errors:
        return CAP_SYS_RESOURCE_FIX
    if "map_files" in errors and "Permission denied" in errors:
        return OTHER_RIGHTS_FIX
    if "Can't dump ghost file" in errors:
        return GHOST_FILE_FIX
    if "io_uring" in errors:
        return proctree.IO_URING_FIX
    if "File exists" in errors and "fork" in errors.lower():
        return "a pid the image needs is in use: wait until the old process is gone"
    if "TCP" in errors or "tcp" in errors:
        return proctree.TCP_FIX
    if "unix" in errors.lower() and ("xternal" in errors or "peer" in errors):
        return proctree.SOCKET_FIX
    return "see the log for the reason"


def write_log(text: str, path: Path) -> Path | None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path
    except OSError:
        return None
