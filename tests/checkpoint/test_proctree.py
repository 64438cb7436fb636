"""Pure parts of the process-tree scan: ss parsing, blockers over a fake /proc of real files."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from spswap.checkpoint import proctree
from spswap.checkpoint.proctree import UnixSocket

# Captured from `ss -xaHn` on a Debian 12 node (paths with a space included on purpose).
SS_OUTPUT = """\
u_str LISTEN 0      256                  /run/munge/munge.socket.2 14977 * 0
u_str ESTAB  0      0                                            * 1230  * 1229
u_str LISTEN 0      32     /tmp/spswap-slurm/spool/vm_3.4294967291 16533 * 0
u_str ESTAB  0      0                                            * 1229  * 1230
u_dgr UNCONN 0      0                                   /dev/log 17990 * 0
u_str ESTAB  0      0                          /tmp/a b/srv.sock 5001 * 5002
garbage line
"""


def test_parse_ss_unix() -> None:
    socks = proctree.parse_ss_unix(SS_OUTPUT)
    assert socks[14977] == UnixSocket("u_str", "LISTEN", 14977, 0, "/run/munge/munge.socket.2")
    assert socks[1230] == UnixSocket("u_str", "ESTAB", 1230, 1229, "")
    assert socks[17990].netid == "u_dgr"
    assert socks[5001].path == "/tmp/a b/srv.sock" and socks[5001].peer_inode == 5002
    assert len(socks) == 6


def _fake_proc(root: Path, fds: dict[int, dict[int, str]]) -> Path:
    for pid, links in fds.items():
        (root / str(pid) / "fd").mkdir(parents=True)
        (root / str(pid) / "task" / str(pid)).mkdir(parents=True)
        for fd, target in links.items():
            os.symlink(target, root / str(pid) / "fd" / str(fd))
    return root


def test_find_blockers(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, {
        10: {0: "/dev/null", 3: "anon_inode:[io_uring]", 4: "socket:[100]", 5: "socket:[300]"},
        11: {3: "socket:[101]", 4: "socket:[200]"},
    })  # fmt: skip
    socks = {
        100: UnixSocket("u_str", "ESTAB", 100, 101, ""),  # peer inside the tree: fine
        101: UnixSocket("u_str", "ESTAB", 101, 100, ""),
        200: UnixSocket("u_str", "ESTAB", 200, 999, ""),  # peer outside: blocks
        300: UnixSocket("u_str", "LISTEN", 300, 0, "/x.sock"),  # listening: fine
    }
    blockers = proctree.find_blockers([10, 11], socks, proc)
    assert [(b.pid, b.fd) for b in blockers] == [(10, 3), (11, 4)]
    assert "io_uring" in blockers[0].what and "io_uring_disabled=2" in blockers[0].fix
    assert "peer 999" in blockers[1].describe()
    # Without socket information only the io_uring is found.
    assert [(b.pid, b.fd) for b in proctree.find_blockers([10, 11], None, proc)] == [(10, 3)]


def test_process_tree_of_a_real_tree() -> None:
    code = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        while len(pids := proctree.process_tree_pids(parent.pid)) < 2:
            assert time.monotonic() < deadline, "the child never appeared"
            time.sleep(0.02)
        assert pids[0] == parent.pid and len(pids) == 2
        assert proctree.children(parent.pid) == pids[1:]
        assert proctree.thread_ids(parent.pid) == [parent.pid]
        assert "python" in proctree.describe_pid(parent.pid)
    finally:
        for pid in reversed(proctree.process_tree_pids(parent.pid)):
            os.kill(pid, 9)
        parent.wait()
    assert proctree.describe_pid(parent.pid) == f"pid {parent.pid} (gone)"
    assert not proctree.pid_exists(parent.pid)
