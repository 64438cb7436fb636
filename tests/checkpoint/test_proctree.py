# ruff: noqa: E501  (verbatim /proc/net/tcp lines)
"""Pure parts of the process-tree scan: blockers over a fake /proc of real files."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spswap.checkpoint import proctree
from spswap.checkpoint.unix_diag import UnixSocket


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


# /proc/net/tcp as Linux prints it: a listener, a loopback connection (both ends), and a
# connection out to 10.0.0.5:22 (header and column layout verbatim).
PROC_NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:9C41 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 700 1 0 100 0 0 10 0
   1: 0100007F:9C42 0100007F:9C41 01 00000000:00000000 00:00000000 00000000     0        0 701 1 0 20 4 30 10 -1
   2: 0100007F:9C41 0100007F:9C42 01 00000000:00000000 00:00000000 00000000     0        0 702 1 0 20 4 30 10 -1
   3: 0A000002:D431 0500000A:0016 01 00000000:00000000 00:00000000 00000000     0        0 703 1 0 20 4 30 10 -1
   4: 0A000002:D432 0500000A:0016 06 00000000:00000000 03:00000000 00000000     0        0 0 3 0 0 0 0 0 0
"""


def test_parse_proc_net_tcp() -> None:
    socks = proctree.parse_proc_net_tcp(PROC_NET_TCP)
    assert sorted(socks) == [700, 701, 702, 703]  # inode 0 (time-wait) skipped
    assert socks[701] == proctree.TcpSocket("0100007F:9C42", "0100007F:9C41", "01", 701, 0)
    assert socks[700].state == "0A"


def test_proc_net_address() -> None:
    assert proctree.proc_net_address("127.0.0.1", 0x9C41) == "0100007F:9C41"
    assert proctree.proc_net_address("10.0.0.5", 22) == "0500000A:0016"
    assert proctree.proc_net_address("::1", 80) == "00000000000000000000000001000000:0050"
    assert (
        proctree.proc_net_address("::ffff:127.0.0.1", 1) == "0000000000000000FFFF00000100007F:0001"
    )


def test_the_owner_of_a_loopback_peer_is_found() -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as srv:
        client = socket.create_connection(srv.getsockname())
        conn, peer = srv.accept()
        with client, conn:
            assert proctree.tcp_peer_uid(peer, conn.getsockname()) == os.getuid()
            assert proctree.tcp_peer_uid(("127.0.0.1", 1), conn.getsockname()) is None


def test_tcp_connections_inside_and_outside(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, {
        10: {3: "socket:[700]", 4: "socket:[701]", 5: "socket:[702]"},
        11: {3: "socket:[703]", 4: "/dev/null"},
    })  # fmt: skip
    socks = proctree.parse_proc_net_tcp(PROC_NET_TCP)
    inside, outside = proctree.tcp_connections([10, 11], socks, proc)
    assert [(p, fd) for p, fd, _ in inside] == [(10, 4), (10, 5)]  # the listener is no link
    assert [(p, fd, s.remote) for p, fd, s in outside] == [(11, 3, "0500000A:0016")]
    # one end alone in the tree: its peer is outside
    inside, outside = proctree.tcp_connections([11], socks, proc)
    assert inside == [] and len(outside) == 1
    proc2 = _fake_proc(tmp_path / "p2", {20: {3: "socket:[701]"}})
    assert proctree.tcp_connections([20], socks, proc2)[1][0][1] == 3


@pytest.mark.parametrize(("log", "fix"), [
    ("(00.2) Error (criu/sk-inet.c:199): inet: Connected TCP socket, consider using "
     "--tcp-established option.", proctree.TCP_FIX),
    ("(00.1) Error (criu/files-ext.c:96): unix: Can't dump external socket, peer 5",
     proctree.SOCKET_FIX),
    ("(00.1) Error (criu/files.c:2): Unknown shit 600 (anon_inode:[io_uring])",
     proctree.IO_URING_FIX),
    # a verbose log names unix sockets and peers in passing: no error, no socket hint
    ("(00.1) unix: Dumping unix socket at 5 peer 6\n(00.2) Error (criu/cr-dump.c:1): "
     "Dump files (pid: 862) failed with -1", "see the log for the reason"),
])  # fmt: skip
def test_hint_for_reads_the_error_lines(log: str, fix: str) -> None:
    from spswap.checkpoint.criu import hint_for

    assert hint_for(log) == fix


def test_anon_rss_bytes_reads_rssanon(tmp_path: Path) -> None:
    from spswap.checkpoint.proctree import anon_rss_bytes

    for pid, kb in ((11, 1024), (12, 3)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "status").write_text(
            f"Name:\tpython3\nVmRSS:\t 99999 kB\nRssAnon:\t    {kb} kB\nRssFile:\t 5 kB\n"
        )
    assert anon_rss_bytes([11, 12, 13], proc=tmp_path) == (1024 + 3) * 1024  # 13: gone
    assert anon_rss_bytes({os.getpid()}) > 1 << 20  # a live Python process


def test_kill_exactly_signals_only_what_is_still_ours() -> None:
    import subprocess

    from spswap.checkpoint.proctree import kill_exactly

    a, b = (subprocess.Popen(["sleep", "60"]) for _ in range(2))
    gone = subprocess.Popen(["true"])
    gone.wait()
    asked: list[int] = []
    try:
        got = kill_exactly([a.pid, b.pid, gone.pid],
                           lambda p: asked.append(p) is None and p == a.pid)  # fmt: skip
        assert got == [a.pid] and asked == [a.pid, b.pid]  # the gone one is not even asked
        assert a.wait(timeout=10) == -9 and b.poll() is None
    finally:
        for p in (a, b):
            p.kill()
            p.wait()
