"""The Unix socket list from the kernel's sock_diag: exact request bytes, the reply parser
on hand-built messages, and one real round trip against sockets this test opens."""

from __future__ import annotations

import shutil
import socket
import struct
import subprocess
from pathlib import Path

import pytest

from spswap.checkpoint import unix_diag
from spswap.checkpoint.unix_diag import UnixSocket
from spswap.errors import CheckpointFailed


def test_request_bytes() -> None:
    assert unix_diag.request(7) == (
        struct.pack("=IHHII", 40, 20, 0x301, 7, 0)
        + struct.pack("=BBHIIIII", 1, 0, 0, 0xFFFFFFFF, 0, 5, 0xFFFFFFFF, 0xFFFFFFFF)
    )


def _attr(kind: int, value: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(value), kind) + value
    return raw + b"\0" * (-len(raw) % 4)


def _msg(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=IHHII", 16 + len(payload), kind, 2, 1, 0) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _sock(kind: int, state: int, inode: int, *attrs: bytes) -> bytes:
    return _msg(20, struct.pack("=BBBBIII", 1, kind, state, 0, inode, 9, 9) + b"".join(attrs))


def test_parse_reply() -> None:
    data = (
        _sock(1, 10, 14977, _attr(0, b"/run/munge/munge.socket.2"))  # listening, named
        + _sock(1, 1, 1230, _attr(2, struct.pack("=I", 1229)))  # connected, unnamed
        + _sock(2, 7, 17990, _attr(0, b"/dev/log"))  # datagram
        + _sock(5, 1, 5001, _attr(0, b"\0abstract name"), _attr(2, struct.pack("=I", 5002)))
        + _msg(3, struct.pack("=i", 0))
    )
    sockets, done = unix_diag.parse_reply(data)
    assert done
    assert sockets == [
        UnixSocket("u_str", "LISTEN", 14977, 0, "/run/munge/munge.socket.2"),
        UnixSocket("u_str", "ESTAB", 1230, 1229, ""),
        UnixSocket("u_dgr", "UNCONN", 17990, 0, "/dev/log"),
        UnixSocket("u_seq", "ESTAB", 5001, 5002, "@abstract name"),
    ]
    more, done = unix_diag.parse_reply(_sock(1, 1, 1, _attr(2, struct.pack("=I", 2))))
    assert not done and more == [UnixSocket("u_str", "ESTAB", 1, 2, "")]


def test_a_netlink_error_names_the_fix() -> None:
    with pytest.raises(CheckpointFailed, match="modprobe unix_diag") as e:
        unix_diag.parse_reply(_msg(2, struct.pack("=i", -2) + b"\0" * 16))
    assert "No such file or directory" in str(e.value)


def test_a_cut_reply_is_a_clear_error() -> None:
    with pytest.raises(CheckpointFailed, match="cut short"):
        unix_diag.parse_reply(_msg(20, b"\x01\x01"))


def _inode(s: socket.socket) -> int:
    return int(Path(f"/proc/self/fd/{s.fileno()}").readlink().name[len("socket:[") : -1])


def test_the_kernel_reports_this_tests_sockets(tmp_path: Path) -> None:
    path = str(tmp_path / "srv.sock")
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(1)
    with a, b, srv:
        found = unix_diag.query()
        ia, ib, isrv = _inode(a), _inode(b), _inode(srv)
        assert found[ia] == UnixSocket("u_str", "ESTAB", ia, ib, "")
        assert found[ib] == UnixSocket("u_str", "ESTAB", ib, ia, "")
        assert found[isrv] == UnixSocket("u_seq", "LISTEN", isrv, 0, path)
        if shutil.which("ss"):  # the same reading ss gets, where ss is installed
            out = subprocess.run(["ss", "-xaHn"], capture_output=True, text=True).stdout
            row = next(line.split() for line in out.splitlines() if f" {ia} " in line)
            assert (row[0], row[1], int(row[-1])) == ("u_str", "ESTAB", ib)
