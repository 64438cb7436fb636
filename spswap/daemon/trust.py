"""What the root daemon may trust on disk and on its socket.

The default root lives on /dev/shm, which every user can write: a user could create
``/dev/shm/spswap`` (or a directory under it) before the daemon does and then steer root's
writes (a symlink where the socket or a log goes, a forged job record). So before root
uses the tree, every directory on it must be root's own, not a symlink, and not writable
by group or others; and a client talks only to a daemon run by root (or by itself).
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from pathlib import Path

from spswap.errors import DaemonError


def unsafe_dir(path: Path, uid: int = 0) -> str | None:
    """Why ``path`` may not hold root's state (None when it may; absent is fine)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != uid:
        return f"{path} is owned by uid {st.st_uid}, not {uid}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def check_server(sock: socket.socket, path: Path) -> None:
    """Talk only to a daemon run by root, or by ourselves (a private test daemon)."""
    uid = peer_uid(sock)
    if uid not in (0, os.getuid()):
        raise DaemonError(
            f"the process serving {path} runs as uid {uid}, not root: it is not spswapd; "
            "nothing was sent. Tell the node's admin"
        )
