"""What a process tree holds, read from /proc: its pids, thread ids, and open files.

CRIU dumps a whole tree, and some things in it cannot be dumped (an io_uring, a connected
Unix stream socket whose peer is outside the tree). Finding them before a dump turns a
mid-swap "Dumping FAILED" into a clear error that names the fix.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from spswap.checkpoint import unix_diag
from spswap.checkpoint.unix_diag import UnixSocket
from spswap.errors import CheckpointFailed

IO_URING_LINK = "anon_inode:[io_uring]"
PROC = Path("/proc")


def children(pid: int, proc: Path = PROC) -> list[int]:
    """Direct children of ``pid`` (every thread's ``children`` file)."""
    kids: list[int] = []
    try:
        tasks = list((proc / str(pid) / "task").iterdir())
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return kids
    for task in tasks:
        try:
            text = (task / "children").read_text()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        kids.extend(int(x) for x in text.split())
    return kids


def process_tree_pids(root_pid: int, proc: Path = PROC) -> list[int]:
    """``root_pid`` and all its descendants, parents before children."""
    out: list[int] = []
    todo = [root_pid]
    seen: set[int] = set()
    while todo:
        pid = todo.pop(0)
        if pid in seen or not (proc / str(pid)).exists():
            continue
        seen.add(pid)
        out.append(pid)
        todo.extend(children(pid, proc))
    return out


def thread_ids(pid: int, proc: Path = PROC) -> list[int]:
    """Every thread id of ``pid`` (including ``pid`` itself)."""
    try:
        return sorted(int(t.name) for t in (proc / str(pid) / "task").iterdir())
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []


def fd_links(pid: int, proc: Path = PROC) -> dict[int, str]:
    """``{fd: link target}`` of ``pid``'s open files (empty if it is gone)."""
    links: dict[int, str] = {}
    fd_dir = proc / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return links
    for name in names:
        try:
            links[int(name)] = os.readlink(fd_dir / name)
        except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
            continue
    return links


def socket_inode(link: str) -> int | None:
    """The inode of a ``socket:[123]`` fd link, None for anything else."""
    if link.startswith("socket:[") and link.endswith("]"):
        return int(link[len("socket:[") : -1])
    return None


def unix_sockets() -> dict[int, UnixSocket] | None:
    """Every Unix socket of this network namespace (from the kernel's sock_diag), or None
    when the kernel does not answer (the check is then skipped)."""
    try:
        return unix_diag.query()
    except CheckpointFailed:
        return None


@dataclass(frozen=True)
class Blocker:
    """Something in the tree that CRIU cannot dump, and what to do about it."""

    pid: int
    fd: int
    what: str
    fix: str

    def describe(self) -> str:
        return f"pid {self.pid} fd {self.fd}: {self.what} ({self.fix})"


IO_URING_FIX = (
    "set `sysctl kernel.io_uring_disabled=2` before the engine starts, so nothing in it "
    "can create an io_uring"
)
SOCKET_FIX = "close client connections before the dump (the engine's drain step does this)"
TCP_FIX = (
    "close TCP connections to peers outside the process tree before the dump; connections "
    "inside the tree (e.g. torch.distributed's store talking to itself) are dumped closed"
)
TCP_ESTABLISHED = "01"  # /proc/net/tcp's state column


@dataclass(frozen=True)
class TcpSocket:
    """One row of /proc/<pid>/net/tcp or tcp6: addresses as the kernel prints them."""

    local: str  # "0100007F:A1B2"
    remote: str
    state: str  # two hex digits; 01 = ESTABLISHED, 0A = LISTEN
    inode: int
    uid: int = -1  # the socket owner's


def parse_proc_net_tcp(text: str) -> dict[int, TcpSocket]:
    """Parse /proc/net/tcp (or tcp6) into ``{inode: TcpSocket}`` (header skipped)."""
    out: dict[int, TcpSocket] = {}
    for line in text.splitlines()[1:]:
        tok = line.split()
        if len(tok) < 10:
            continue
        try:
            inode, uid = int(tok[9]), int(tok[7])
        except ValueError:
            continue
        if inode:
            out[inode] = TcpSocket(tok[1], tok[2], tok[3], inode, uid)
    return out


def proc_net_address(host: str, port: int) -> str:
    """An address as /proc/net/tcp{,6} prints it: each 32-bit word of the address in host
    (little-endian) order, in hex, then the port (``127.0.0.1``, 8080 ->
    ``0100007F:1F90``)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    raw = socket.inet_pton(family, host)
    words = "".join(raw[i : i + 4][::-1].hex().upper() for i in range(0, len(raw), 4))
    return f"{words}:{port:04X}"


def tcp_peer_uid(peer: tuple[str, int], local: tuple[str, int],
                 proc: Path = PROC) -> int | None:  # fmt: skip
    """Who owns the other end of a TCP connection made on this node to ``local`` from
    ``peer`` (that end is the row whose local address is ``peer``); None if not found."""
    want = (proc_net_address(*peer), proc_net_address(*local))
    return next((row.uid for row in tcp_sockets("self", proc).values()
                 if (row.local, row.remote) == want), None)  # fmt: skip


def tcp_sockets(pid: int | str, proc: Path = PROC) -> dict[int, TcpSocket]:
    """Every TCP socket of ``pid``'s network namespace (IPv4 and IPv6)."""
    out: dict[int, TcpSocket] = {}
    for name in ("tcp", "tcp6"):
        try:
            out.update(parse_proc_net_tcp((proc / str(pid) / "net" / name).read_text()))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return out


def tcp_connections(
    pids: list[int], sockets: dict[int, TcpSocket], proc: Path = PROC
) -> tuple[list[tuple[int, int, TcpSocket]], list[tuple[int, int, TcpSocket]]]:
    """The tree's established TCP connections as ``(inside, outside)`` lists of
    ``(pid, fd, socket)``: inside when the other end is also a socket of the tree (a
    loopback connection to itself), outside otherwise."""
    mine: list[tuple[int, int, TcpSocket]] = []
    for pid in pids:
        for fd, link in sorted(fd_links(pid, proc).items()):
            ino = socket_inode(link)
            if ino is not None and ino in sockets and sockets[ino].state == TCP_ESTABLISHED:
                mine.append((pid, fd, sockets[ino]))
    ends = {(s.local, s.remote) for _, _, s in mine}
    inside = [m for m in mine if (m[2].remote, m[2].local) in ends]
    outside = [m for m in mine if (m[2].remote, m[2].local) not in ends]
    return inside, outside


def find_blockers(
    pids: list[int], sockets: dict[int, UnixSocket] | None, proc: Path = PROC
) -> list[Blocker]:
    """io_urings and connected Unix stream sockets to peers outside ``pids``.

    ``sockets`` comes from :func:`unix_sockets`; when it is None the socket check is
    skipped (best effort), the io_uring check still runs.
    """
    links = {pid: fd_links(pid, proc) for pid in pids}
    tree_inodes = {
        ino for fds in links.values() for link in fds.values()
        if (ino := socket_inode(link)) is not None
    }  # fmt: skip
    blockers: list[Blocker] = []
    for pid, fds in links.items():
        for fd, link in sorted(fds.items()):
            if link == IO_URING_LINK:
                blockers.append(Blocker(pid, fd, "an io_uring instance", IO_URING_FIX))
                continue
            ino = socket_inode(link)
            if ino is None or sockets is None or ino not in sockets:
                continue
            s = sockets[ino]
            if s.netid in ("u_str", "u_seq") and s.state == "ESTAB":
                if s.peer_inode and s.peer_inode not in tree_inodes:
                    what = f"a connected Unix stream socket (inode {ino}, peer {s.peer_inode})"
                    blockers.append(Blocker(pid, fd, what, SOCKET_FIX))
    return blockers


def describe_pid(pid: int, proc: Path = PROC) -> str:
    """``"pid 123 (python3, state S, parent 1)"``, or ``"pid 123 (gone)"``."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return f"pid {pid} (gone)"
    comm = stat[stat.find("(") + 1 : stat.rfind(")")]
    fields = stat[stat.rfind(")") + 2 :].split()
    return f"pid {pid} ({comm}, state {fields[0]}, parent {fields[1]})"


def pid_exists(pid: int, proc: Path = PROC) -> bool:
    """True while ``/proc/<pid>`` exists (a zombie counts: its pid is still taken)."""
    return pid > 0 and (proc / str(pid)).exists()


def anon_rss_bytes(pids: list[int] | set[int], proc: Path = PROC) -> int:
    """Resident anonymous memory of ``pids`` together (``RssAnon`` of /proc/<pid>/status):
    what a tree kept alive after its dump holds, its GPU state included (the CUDA
    checkpoint moved that into host memory). Gone processes count 0."""
    total = 0
    for pid in pids:
        try:
            text = (proc / str(pid) / "status").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("RssAnon:"):
                total += int(line.split()[1]) * 1024  # kB
                break
    return total


def kill_exactly(pids: Iterable[int], still_ours: Callable[[int], bool]) -> list[int]:
    """SIGKILL each of ``pids`` that is still the process the caller listed, never one
    that took its number since: a pidfd is opened first (it names that one process
    whatever happens to the number), then ``still_ours(pid)`` is asked (still in the
    cgroup or the tree; asked for all before any is signalled, so a tree is judged as
    it was), then the signal goes through the pidfd. The pids signalled."""
    fds: dict[int, int] = {}
    try:
        for pid in pids:
            try:
                fds[pid] = os.pidfd_open(pid)
            except OSError:  # gone already
                continue
        ours = [(pid, fd) for pid, fd in fds.items() if still_ours(pid)]
        out = []
        for pid, fd in ours:
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                out.append(pid)
            except ProcessLookupError:
                pass
        return out
    finally:
        for fd in fds.values():
            os.close(fd)


def wait_pids_free(pids: list[int], timeout_s: float) -> None:
    """Wait until none of ``pids`` exists, reaping those that are our zombie children."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = [p for p in pids if pid_exists(p)]
        for p in busy:
            try:
                os.waitpid(p, os.WNOHANG)
            except ChildProcessError:
                pass
        busy = [p for p in busy if pid_exists(p)]
        if not busy:
            return
        if time.monotonic() >= deadline:
            who = ", ".join(describe_pid(p) for p in busy)
            raise CheckpointFailed(
                f"cannot restore: {who} still in use after {timeout_s:g} s, and the image "
                "needs the same pid; wait until that process exits (or stop it) and try again"
            )
        time.sleep(0.02)


def preflight(pid: int) -> tuple[list[int], bool]:
    """Refuse a dump that CRIU would fail mid-way; returns the tree's pids and whether it
    holds TCP connections to itself (dumped with ``--tcp-close``).

    Raises CheckpointFailed naming every io_uring, every connected Unix stream socket and
    every TCP connection to an outside peer, with the fix.
    """
    if not pid_exists(pid):
        raise CheckpointFailed(f"cannot dump pid {pid}: no such process")
    pids = process_tree_pids(pid)
    blockers = find_blockers(pids, unix_sockets())
    inside, outside = tcp_connections(pids, tcp_sockets(pid))
    blockers += [Blocker(p, fd, f"a TCP connection {s.local} -> {s.remote}", TCP_FIX)
                 for p, fd, s in outside]  # fmt: skip
    if blockers:
        lines = "\n".join("  " + b.describe() for b in blockers)
        raise CheckpointFailed(f"cannot dump pid {pid}: CRIU cannot save these:\n{lines}")
    return pids, bool(inside)
