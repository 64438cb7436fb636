"""The node's Unix sockets and their peers, asked of the kernel over netlink (sock_diag),
as ``ss -x`` does, without needing ``ss``: GPU images often lack iproute2.

Only a connected socket's peer inode tells whether the peer is inside a tree CRIU is about
to dump; /proc/net/unix does not carry it. The request and the reply parser are pure
functions over bytes; :func:`query` does the one netlink round trip.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

from spswap.errors import CheckpointFailed

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
UDIAG_SHOW_NAME = 0x1
UDIAG_SHOW_PEER = 0x4
UNIX_DIAG_NAME = 0
UNIX_DIAG_PEER = 2

NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
UNIX_DIAG_REQ = struct.Struct("=BBHIIIII")  # family, protocol, pad, states, ino, show, cookie
UNIX_DIAG_MSG = struct.Struct("=BBBBIII")  # family, type, state, pad, ino, cookie
RTATTR = struct.Struct("=HH")  # len, type

NETIDS = {socket.SOCK_STREAM: "u_str", socket.SOCK_DGRAM: "u_dgr",
          socket.SOCK_SEQPACKET: "u_seq"}  # fmt: skip
# TCP state numbers, as ss names them for Unix sockets
STATES = {1: "ESTAB", 2: "SYN-SENT", 7: "UNCONN", 10: "LISTEN"}


@dataclass(frozen=True)
class UnixSocket:
    """One Unix socket as the kernel reports it (and ``ss -xa`` would print it)."""

    netid: str  # u_str, u_seq, u_dgr
    state: str  # ESTAB, LISTEN, UNCONN, ...
    inode: int
    peer_inode: int  # 0: none
    path: str  # "" unnamed; "@name" abstract


def request(seq: int = 1) -> bytes:
    """A dump request for every Unix socket of the namespace, with names and peers."""
    show = UDIAG_SHOW_NAME | UDIAG_SHOW_PEER
    body = UNIX_DIAG_REQ.pack(socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, show, 0xFFFFFFFF, 0xFFFFFFFF)
    return NLMSGHDR.pack(NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY,
                         NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body  # fmt: skip


def _align4(n: int) -> int:
    return (n + 3) & ~3


def _name(raw: bytes) -> str:
    if not raw:
        return ""
    if raw[0] == 0:  # abstract: a leading NUL, the rest is the name (not NUL-terminated)
        return "@" + raw[1:].decode(errors="replace")
    return raw.split(b"\0", 1)[0].decode(errors="replace")


def parse_socket(payload: bytes) -> UnixSocket:
    """One ``unix_diag_msg`` and its attributes."""
    _family, kind, state, _pad, inode, _c0, _c1 = UNIX_DIAG_MSG.unpack_from(payload)
    peer, path = 0, ""
    off = UNIX_DIAG_MSG.size
    while off + RTATTR.size <= len(payload):
        length, kind_attr = RTATTR.unpack_from(payload, off)
        if length < RTATTR.size:
            break
        value = payload[off + RTATTR.size : off + length]
        if kind_attr == UNIX_DIAG_PEER and len(value) >= 4:
            peer = struct.unpack_from("=I", value)[0]
        elif kind_attr == UNIX_DIAG_NAME:
            path = _name(value)
        off += _align4(length)
    return UnixSocket(NETIDS.get(kind, f"u_{kind}"), STATES.get(state, str(state)), inode,
                      peer, path)  # fmt: skip


def parse_reply(data: bytes) -> tuple[list[UnixSocket], bool]:
    """The sockets in one recv's worth of netlink messages, and whether the dump ended.

    Raises CheckpointFailed on a netlink error message (the kernel refused the dump)."""
    out: list[UnixSocket] = []
    off = 0
    while off + NLMSGHDR.size <= len(data):
        length, kind, _flags, _seq, _pid = NLMSGHDR.unpack_from(data, off)
        if length < NLMSGHDR.size:
            break
        payload = data[off + NLMSGHDR.size : off + length]
        if kind == NLMSG_DONE:
            return out, True
        if kind == NLMSG_ERROR:
            errno = -struct.unpack_from("=i", payload)[0] if len(payload) >= 4 else 0
            raise CheckpointFailed(
                f"the kernel refused the Unix socket list (sock_diag: "
                f"{os.strerror(errno) if errno else 'error'}); load the unix_diag module "
                "(modprobe unix_diag) or check that netlink is allowed here"
            )  # fmt: skip
        if kind == SOCK_DIAG_BY_FAMILY:
            try:
                out.append(parse_socket(payload))
            except struct.error:
                raise CheckpointFailed(
                    "the kernel's Unix socket list was cut short (sock_diag); try again"
                ) from None
        off += _align4(length)
    return out, False


def query(timeout_s: float = 10.0) -> dict[int, UnixSocket]:
    """Every Unix socket of this network namespace, ``{inode: UnixSocket}``.

    Raises CheckpointFailed when netlink or the kernel's unix_diag is not available."""
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC,
                             NETLINK_SOCK_DIAG)  # fmt: skip
    except OSError as e:
        raise CheckpointFailed(f"cannot open a sock_diag netlink socket: {e}") from e
    with sock:
        sock.settimeout(timeout_s)
        try:
            sock.sendto(request(), (0, 0))
            found: dict[int, UnixSocket] = {}
            while True:
                sockets, done = parse_reply(sock.recv(1 << 16))
                found.update((s.inode, s) for s in sockets)
                if done:
                    return found
        except OSError as e:
            raise CheckpointFailed(f"listing Unix sockets over netlink failed: {e}") from e
