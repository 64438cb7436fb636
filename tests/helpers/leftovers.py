"""Ending what a test started under its own spswap root, wherever it went.

A restored or kept instance is not the test's child: CRIU gives it back its pid and its
own session, and a kept one sits frozen in a parked cgroup. A test's ``kill`` of its
children misses it, and on the GPU machine it then holds tens of GiB for every later
step (seen on the H200: a restored vLLM server with 44 GiB, 16 minutes after its test).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

PROC = Path("/proc")


def pids_under(root: Path, proc: Path = PROC) -> list[int]:
    """The processes whose environment says ``SPSWAP_ROOT=root`` or whose command line
    names ``root`` (spswapd, the jobs' runs and every child they started), this one aside."""
    mark_env = f"SPSWAP_ROOT={root}".encode()
    mark_cmd = str(root).encode()
    found = []
    for d in proc.iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            cmd = (d / "cmdline").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if mark_env in env or mark_cmd in cmd:
            found.append(int(d.name))
    return found


def end_all_under(root: Path) -> list[int]:
    """SIGKILL every process :func:`pids_under` finds (a frozen one dies too: cgroup v2
    lets a fatal signal through the freezer); returns their pids."""
    pids = pids_under(root)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids
