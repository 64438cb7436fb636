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

from spswap.config import Config
from spswap.errors import DaemonError, PermissionDenied


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


def check_root_tree(cfg: Config) -> None:
    """Refuse to run as root on a state tree someone else could have prepared.

    The slot directory is left out: it is meant to be traversed (0755) and its files are
    the slot table's own business (it repairs their modes as root).
    """
    if os.geteuid() != 0:
        return
    p = cfg.paths
    for d in (cfg.root, p.run, p.log, p.images, p.pool, p.run / "jobs",
              p.run / "checkpoints", p.run / "instances"):  # fmt: skip
        why = unsafe_dir(d)
        if why:
            raise PermissionDenied(
                f"{why}: spswapd (root) will not use it, since another user could have "
                f"prepared it; remove it (rm -rf {d}) and run `spswap daemon start` as root, "
                "or set SPSWAP_ROOT to a root-owned directory (e.g. /run/spswap)"
            )


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
