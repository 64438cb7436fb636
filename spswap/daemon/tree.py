"""Root's state tree, claimed and made through directory descriptors.

A path is looked up again at every use, so a check by path and a later mkdir or chmod
by path may meet two different things: a user who recreates ``$SPSWAP_ROOT`` in between
(on /dev/shm anyone can) gets root to create or chmod through her symlinks. So as root
the tree is opened from its parent's descriptor with ``O_NOFOLLOW | O_DIRECTORY``,
checked with ``fstat`` on what was opened, created with ``mkdir(dir_fd=)`` and chmod'ed
with ``fchmod``. A root directory that is not root's is swapped out in one step
(``RENAME_EXCHANGE`` with a fresh root-owned directory under an unguessable name), so no
name a user plants can block the move, and one who recreates the root in a loop only
makes this retry. Once the root is root's and writable by root alone, in a parent no
user can rename it out of, nothing under it can change hands: later opens by path are
safe.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import stat
import time
from pathlib import Path

from spswap.errors import DaemonError, PermissionDenied

O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
DIR_MODE = 0o755
MAX_CLAIMS = 1000
"""Tries before giving up on a root that keeps being recreated (each try is atomic)."""
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_libc = ctypes.CDLL(None, use_errno=True)


def renameat2(src_fd: int, src: str, dst_fd: int, dst: str, flags: int) -> None:
    """``renameat2(2)``; ``OSError(EINVAL)`` where the libc or file system lacks it."""
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        raise OSError(errno.EINVAL, "renameat2 is not available")
    if fn(src_fd, os.fsencode(src), dst_fd, os.fsencode(dst), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), src, None, dst)


def aside_name(name: str, uid: int) -> str:
    """Where a foreign ``name`` goes: readable for an admin, random so no user can take it
    first (a planted directory of that name would have made the move fail)."""
    return f"{name}.untrusted-{int(time.time())}-{uid}-{secrets.token_hex(8)}"


def open_dir(parent_fd: int, name: str) -> tuple[int | None, os.stat_result | None]:
    """``name`` in ``parent_fd`` opened without following a symlink: ``(fd, its stat)``;
    ``(None, lstat)`` for a symlink or non-directory, ``(None, None)`` when absent."""
    try:
        fd = os.open(name, O_DIR, dir_fd=parent_fd)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        try:
            return None, os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None, None
    return fd, os.fstat(fd)


def claim_root(parent_fd: int, name: str) -> tuple[int, str | None, bool]:
    """A descriptor of directory ``name`` in ``parent_fd`` that root owns, after moving
    aside whatever another user had there: ``(fd, aside name or None, made here)``."""
    aside, fresh_ino = None, -1
    for _ in range(MAX_CLAIMS):
        created = _mkdir(parent_fd, name)
        fd, st = open_dir(parent_fd, name)
        if st is None:
            continue  # gone again before we opened it
        if fd is not None and st.st_uid == 0:
            return fd, aside, created or st.st_ino == fresh_ino
        if fd is not None:
            os.close(fd)
        moved = _move_aside(parent_fd, name, st.st_uid)
        if moved is not None:
            aside, fresh_ino = moved
    raise DaemonError(
        f"{name} kept being recreated by another user ({MAX_CLAIMS} tries); see who with "
        f"`ls -la` in its parent directory, stop them, and run `spswap daemon start` again"
    )


def _mkdir(parent_fd: int, name: str) -> bool:
    try:
        os.mkdir(name, DIR_MODE, dir_fd=parent_fd)
    except FileExistsError:
        return False
    return True


def _move_aside(parent_fd: int, name: str, uid: int) -> tuple[str, int] | None:
    """Swap ``name`` for a fresh root-owned directory in one step: where the foreign one
    went and the fresh one's inode (-1: none made), or None when it was gone already.
    Without ``RENAME_EXCHANGE`` (some file systems): a rename that never replaces
    anything, to a name no user knows."""
    fresh = aside_name(name, uid)
    os.mkdir(fresh, DIR_MODE, dir_fd=parent_fd)  # unguessable: no one made it first
    ino = os.stat(fresh, dir_fd=parent_fd, follow_symlinks=False).st_ino
    try:
        renameat2(parent_fd, fresh, parent_fd, name, RENAME_EXCHANGE)
        return fresh, ino  # ``name`` is root's fresh directory now, the foreign one ``fresh``
    except OSError as e:
        os.rmdir(fresh, dir_fd=parent_fd)
        if e.errno == errno.ENOENT:
            return None
        if e.errno not in (errno.EINVAL, errno.ENOSYS):
            raise
    dst = aside_name(name, uid)
    try:
        renameat2(parent_fd, name, parent_fd, dst, RENAME_NOREPLACE)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOSYS):
            raise
        try:
            os.rename(name, dst, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
        except FileNotFoundError:
            return None
    return dst, -1


def loose_mode(st: os.stat_result) -> bool:
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def open_parent(root: Path) -> int:
    """The root's parent directory, walked from ``/`` one ``O_NOFOLLOW`` step at a time
    (missing steps made 0755): each must be root's and, unless sticky, writable by root
    alone, else a user could rename root's tree out from under it and put hers there."""
    real = Path(os.path.realpath(root.parent))  # an admin's links (/var/run), once
    fd = os.open("/", O_DIR)
    try:
        for i, part in enumerate(real.parts[1:], start=2):
            nfd, st = open_dir(fd, part)
            made = False
            if st is None:  # missing (mkdir only then: an existing step may be read-only)
                made = _mkdir(fd, part)
                nfd, st = open_dir(fd, part)
            here = Path(*real.parts[:i])
            if nfd is None:
                raise _untrusted(root, f"{here} is not a directory (or was replaced)")
            os.close(fd)
            fd = nfd
            assert st is not None
            if made and st.st_uid == 0:
                os.fchmod(fd, DIR_MODE)  # whatever the umask: users traverse it to the socket
            if st.st_uid != 0:
                raise _untrusted(root, f"{here} is owned by uid {st.st_uid}, not root")
            if loose_mode(st) and not st.st_mode & stat.S_ISVTX:
                raise _untrusted(root, f"{here} is writable by group or others and not sticky "
                                       f"(mode {stat.S_IMODE(st.st_mode):o})")  # fmt: skip
    except BaseException:
        os.close(fd)
        raise
    return fd


def _untrusted(root: Path, why: str) -> PermissionDenied:
    return PermissionDenied(
        f"{why}: another user could replace spswapd's state tree {root} there, so spswapd "
        "(root) will not use it; set SPSWAP_ROOT to a directory whose parents only root can "
        "change (e.g. /run/spswap or /dev/shm/spswap) and run `spswap daemon start` again"
    )


def check_dir(st: os.stat_result, path: Path) -> None:
    """Refuse a directory of the tree that another user could have prepared."""
    why = None
    if st.st_uid != 0:
        why = f"{path} is owned by uid {st.st_uid}, not 0"
    elif loose_mode(st):
        why = f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    if why:
        raise PermissionDenied(
            f"{why}: spswapd (root) will not use it, since another user could have "
            f"prepared it; remove it (rm -rf {path}) and run `spswap daemon start` as root, "
            "or set SPSWAP_ROOT to a root-owned directory (e.g. /run/spswap)"
        )


MADE = ("run", "log")
"""Made by the daemon at start (0755: users traverse run/ to the socket, read log/)."""
CHECKED = ("images", "pool", "run/jobs", "run/checkpoints", "run/instances")
"""Made later by their owners; checked at start when there. slots/ is left out: it is
meant to be traversed and the slot table repairs its files' modes as root."""


def prepare(root: Path) -> str | None:
    """Claim ``root`` and make and check its tree, every step from a verified descriptor;
    the name a foreign root was moved to, or None."""
    parent_fd = open_parent(root)
    try:
        root_fd, aside, created = claim_root(parent_fd, root.name)
    finally:
        os.close(parent_fd)
    try:
        if created:  # ours: 0755 whatever the caller's umask (users reach the socket)
            os.fchmod(root_fd, DIR_MODE)
        check_dir(os.fstat(root_fd), root)
        for name in MADE:
            _make_sub(root_fd, name, root / name)
        for rel in CHECKED:
            _check_sub(root_fd, rel, root)
    finally:
        os.close(root_fd)
    return aside


def _make_sub(root_fd: int, name: str, path: Path) -> None:
    made = _mkdir(root_fd, name)
    fd, st = open_dir(root_fd, name)
    if fd is None:  # only root writes in a checked root: a link or file that root left
        raise PermissionDenied(f"{path} is not a directory (a link or a file): spswapd "
                               f"(root) will not use it; remove it (rm {path}) and run "
                               "`spswap daemon start` again")  # fmt: skip
    try:
        assert st is not None
        check_dir(st, path)
        if made or name == "run":  # run/ must stay traversable (the socket) whatever made it
            os.fchmod(fd, DIR_MODE)
    finally:
        os.close(fd)


def _check_sub(root_fd: int, rel: str, root: Path) -> None:
    fds: list[int] = []
    try:
        at = root_fd
        for i, part in enumerate(rel.split("/"), start=1):
            fd, st = open_dir(at, part)
            path = root.joinpath(*rel.split("/")[:i])
            if st is None:
                return  # not made yet: whoever makes it makes it root's
            if fd is None:
                raise PermissionDenied(f"{path} is not a directory (a link or a file): "
                                       f"spswapd (root) will not use it; remove it (rm {path}) "
                                       "and run `spswap daemon start` again")  # fmt: skip
            fds.append(fd)
            check_dir(st, path)
            at = fd
    finally:
        for fd in fds:
            os.close(fd)
