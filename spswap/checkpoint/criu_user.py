"""CRIU started as the job's user (``--unprivileged``): who that user is, and the image
directory handed to that user for one CRIU run.

Root starts CRIU through ``setpriv`` (``criu_argv.as_user_argv``) with only the
capabilities that mode needs, so the kernel's own checks apply to every path CRIU opens.
The image directory is the user's for the run but sits in root's 0700 images root: CRIU
reaches it only through a descriptor root opened (``/proc/self/fd/N``) and no other
process of the user can; root takes the files back afterwards.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from spswap.checkpoint import criu_argv
from spswap.errors import CheckpointFailed


@dataclass(frozen=True)
class RunAs:
    """The user CRIU runs as (``--unprivileged``): the job's uid, its primary gid and its
    supplementary groups."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    @classmethod
    def for_uid(cls, uid: int) -> RunAs:
        """The user database's gid and groups of ``uid``; CheckpointFailed when it does
        not know the uid (CRIU would run with groups the processes may not have)."""
        import pwd

        try:
            pw = pwd.getpwuid(uid)
        except KeyError:
            raise CheckpointFailed(
                f"uid {uid} is not in this node's user database, so CRIU cannot run as that "
                "user; make the user known to the node (NSS), or set SPSWAP_CRIU_AS_ROOT=1"
            ) from None
        groups = sorted(set(os.getgrouplist(pw.pw_name, pw.pw_gid)))
        return cls(uid, pw.pw_gid, tuple(groups))

    def prefix(self) -> list[str]:
        """The ``setpriv`` command line that starts CRIU as this user."""
        setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
        return criu_argv.as_user_argv(setpriv, uid=self.uid, gid=self.gid,
                                      groups=list(self.groups), caller_pid=os.getpid())  # fmt: skip


def root_prefix() -> list[str]:
    """The command line that starts root's CRIU (a dump or a restore) so that it dies
    with spswapd (:data:`criu_argv.DIE_WITH_CALLER`); none where setpriv is missing."""
    setpriv = shutil.which("setpriv")
    return criu_argv.as_root_argv(setpriv, os.getpid()) if setpriv else []


def chown_tree(top: Path, uid: int, gid: int, file_mode: int | None = None) -> None:
    """Give ``top`` and everything in it (no symlink followed) to ``uid``:``gid``."""
    os.lchown(top, uid, gid)
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            child = os.path.join(dirpath, name)
            os.lchown(child, uid, gid)
            if file_mode is not None and name in filenames and not os.path.islink(child):
                os.chmod(child, file_mode)


@contextlib.contextmanager
def as_user_dir(directory: Path, run_as: RunAs | None) -> Iterator[tuple[str, list[int]]]:
    """The images-dir argument for CRIU and the descriptors it must inherit: the path as it
    is for root's CRIU; for a user's, the directory handed to the user for the run and
    reached through a descriptor (its parent is root's 0700 images root), taken back by
    root afterwards."""
    if run_as is None:
        yield str(directory), []
        return
    chown_tree(directory, run_as.uid, run_as.gid)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}", [fd]
    finally:
        os.close(fd)
        if directory.exists():
            chown_tree(directory, 0, 0, file_mode=0o600)


ROOT_ANSWER_WAIT_S = 5.0  # how long root waits for the script to listen for its answer


@dataclass
class RootPostDump:
    """Where a user's post-dump script asks root for the freeze, and what came of it."""

    script_dir: Path  # root's, 0711: the script and the FIFOs (the user can neither add,
    request: Path  # remove nor rename entries here; the name is random)
    answer: Path
    done: threading.Event
    problems: list[str]


@contextlib.contextmanager
def root_post_dump(parent: Path, run_as: RunAs, writes: list[tuple[str, str]]
                   ) -> Iterator[RootPostDump]:  # fmt: skip
    """A dump by CRIU as the job's user that leaves the tree running: the tree must be
    frozen (``writes``: its parked cgroup's freezer) while CRIU still holds it stopped,
    and only root may write that. The user's post-dump script writes to ``request``;
    a root thread then makes the writes and answers on ``answer``, which the script
    waits for before it lets CRIU go on. Whatever the user's side does, root only ever
    writes these fixed values to these fixed files, and the daemon checks the freeze."""
    top = Path(tempfile.mkdtemp(prefix=".postdump-", dir=parent))
    os.chmod(top, 0o711)
    hook = RootPostDump(top, top / "request", top / "answer", threading.Event(), [])
    for fifo in (hook.request, hook.answer):
        os.mkfifo(fifo, 0o600)
        os.chown(fifo, run_as.uid, run_as.gid)
    flags = os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    rfd = os.open(hook.request, os.O_RDONLY | flags)
    keep_open = os.open(hook.request, os.O_WRONLY | flags)  # no EOF while nobody writes
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            ready, _, _ = select.select([rfd], [], [], 0.05)
            if ready and os.read(rfd, 64):
                break
        else:
            return
        for path, value in writes:
            try:
                with open(path, "w") as f:
                    f.write(value)
            except OSError as e:
                hook.problems.append(f"{path}: {e}")
        _answer(hook.answer, hook.problems)
        hook.done.set()

    thread = threading.Thread(target=serve, name="spswap-post-dump", daemon=True)
    thread.start()
    try:
        yield hook
    finally:
        stop.set()
        thread.join(ROOT_ANSWER_WAIT_S + 1)
        os.close(rfd)
        os.close(keep_open)
        shutil.rmtree(top, ignore_errors=True)


def _answer(path: Path, problems: list[str]) -> None:
    """Wake the script waiting in ``read`` (opening for writing fails with ENXIO until it
    has opened its end)."""
    deadline = time.monotonic() + ROOT_ANSWER_WAIT_S
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
            break
        except OSError as e:
            if e.errno != errno.ENXIO or time.monotonic() > deadline:
                problems.append(f"no answer to the post-dump script ({e})")
                return
            time.sleep(0.002)
    try:
        os.write(fd, b"done\n")
    finally:
        os.close(fd)
