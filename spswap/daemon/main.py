"""``spswapd`` in the foreground: take the pid-file lock, serve, clean up.

Run by :func:`spswap.daemon.lifecycle.start` (detached) or by systemd
(``spswap daemon run``). All state lives on tmpfs under the root, so a daemon started
after a crash carries on with the pool, slots, jobs and images as they were.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from spswap.config import Config
from spswap.daemon import lifecycle
from spswap.daemon.budget import raise_fd_limit
from spswap.daemon.ckpt_recover import on_daemon_start
from spswap.daemon.server import Server, install_signal_handlers
from spswap.daemon.sweeper import Sweeper
from spswap.errors import DaemonError
from spswap.settings_check import settings_problems

if TYPE_CHECKING:
    from spswap.daemon.state import DaemonState


def _take_pid_lock(cfg: Config) -> int | None:
    """The locked pid-file descriptor, or None when another daemon holds it."""
    # root's alone: a user holding a shared flock on it would make every new daemon think
    # one runs already (flock needs only a read-only descriptor)
    # O_NOFOLLOW: the tree is checked, but a pid file is never written through a link
    fd = os.open(lifecycle.pid_path(cfg), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                 0o600)  # fmt: skip
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    os.fchmod(fd, 0o600)
    return fd


def _warn_unfit_settings(state: DaemonState) -> None:
    """Settings this node cannot hold, in the daemon's log and event log (a warning: a
    daemon that refused to start would leave every job of the node without spswap)."""
    for problem in settings_problems(state.cfg):
        print(f"{time.strftime('%F %T')} spswapd: warning: {problem}", flush=True)
        state.event("settings.unfit", uid=os.getuid(), reason=problem)


def _name_process(proc_self: Path = Path("/proc/self")) -> None:
    """Call this process spswapd where the kernel names processes (``ps -e``, ``pgrep
    spswapd``, ``top``): its command line says ``python -m spswap.daemon``. Best effort."""
    with contextlib.suppress(OSError):
        (proc_self / "comm").write_text("spswapd")


def run(cfg: Config) -> int:
    """Serve until SIGTERM/SIGINT; 0 on a clean stop, 0 also when one already runs."""
    raise_fd_limit()  # before the server sizes each user's share from it
    _name_process()
    lifecycle.prepare_dirs(cfg)
    os.umask(0o022)
    lock_fd = _take_pid_lock(cfg)
    if lock_fd is None:
        other = lifecycle.daemon_running(cfg)
        print(f"{time.strftime('%F %T')} spswapd: already running (pid {other}); exiting",
              flush=True)  # fmt: skip
        return 0
    server = Server(cfg)
    try:
        server.bind()
        install_signal_handlers(server)
        server.state.jobs.dir.mkdir(parents=True, exist_ok=True)

        on_daemon_start(server.state)  # before the first request is served
        server.state.event("daemon.start", uid=os.getuid(), pid=os.getpid(),
                           socket=str(cfg.paths.socket))  # fmt: skip
        print(f"{time.strftime('%F %T')} spswapd: pid {os.getpid()} serving "
              f"{cfg.paths.socket}", flush=True)  # fmt: skip
        _warn_unfit_settings(server.state)

        sweeper = Sweeper(server.state, cfg.sweep_interval_s)
        sweeper.start()
        server.serve_forever()
        sweeper.stop()
        if not server.orphaned:  # else its root is gone: recreate nothing there
            server.state.event("daemon.stop", uid=os.getuid(), pid=os.getpid())
        print(f"{time.strftime('%F %T')} spswapd: stopped", flush=True)
        return 0
    finally:
        server.close()
        # unlink nothing else: the pid file stays (its lock tells liveness), and
        # pool, slots, jobs and images must outlive the daemon
        os.close(lock_fd)


def main() -> int:
    try:
        return run(Config.load())
    except DaemonError as e:
        print(f"spswapd: {e}", file=sys.stderr, flush=True)
        return 1
