"""Start, find, stop and ensure the node daemon.

The daemon holds an exclusive ``flock`` on ``run/spswapd.pid`` for its whole life, so a
pid file left by a crashed daemon is recognised as stale (nobody holds its lock) without
trusting the pid in it. :func:`ensure` is on the Slurm prolog's path: when the daemon
runs it costs one ``flock`` probe and one socket ping, and imports nothing heavy.

Starting from a Slurm prolog has two traps (slurmd kills the prolog's process group as
soon as it exits, and reads the prolog's stdout/stderr until EOF). :func:`start`
therefore launches the daemon in its own session (``setsid``) with stdin from
``/dev/null`` and stdout/stderr to the daemon's log, then waits until the child really
leads its own session and answers a ping, before the prolog may exit.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from spswap.config import Config
from spswap.errors import DaemonError, PermissionDenied

PID_FILE = "spswapd.pid"
START_LOCK = "spswapd.start.lock"
LOG_FILE = "spswapd.log"


def pid_path(cfg: Config) -> Path:
    return cfg.paths.run / PID_FILE


def log_path(cfg: Config) -> Path:
    """The daemon's own stdout/stderr and tracebacks."""
    return cfg.paths.log / LOG_FILE


def daemon_running(cfg: Config) -> int | None:
    """The pid of the live daemon for this root, or None (no pid file, or a stale one).
    A user, who may not open root's pid file, gets -1 (running, pid not shown) when the
    daemon answers a ping, else None."""
    try:
        fd = os.open(pid_path(cfg), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except PermissionError:
        return -1 if ping(cfg) else None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return None  # a link: no daemon writes its pid file through one
        raise
    try:
        if os.geteuid() == 0 and os.fstat(fd).st_uid != 0:
            return None  # a user's file (in a tree she made): root signals no pid from it
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            # the lock is taken before the pid is written: a just-started daemon may
            # briefly show an empty file; it is running all the same
            return int(text) if text.isdigit() else -1
        return None  # we got the lock: nobody holds it, the pid file is stale
    finally:
        os.close(fd)  # also drops our probe lock


def ping(cfg: Config, timeout_s: float = 1.0) -> bool:
    """True when the daemon answers a ping on its socket."""
    from spswap.daemon.client import Client

    try:
        Client(cfg, timeout_s=timeout_s).call("ping")
    except DaemonError:
        return False
    return True


def _wait_ready(cfg: Config, pid: int | None, deadline: float) -> int:
    while True:
        running = daemon_running(cfg)
        if running and running > 0 and ping(cfg, timeout_s=max(0.05, deadline - time.monotonic())):
            return running
        if pid is not None and _exited(pid):
            raise DaemonError(f"spswapd exited right after it started; see {log_path(cfg)} for why")
        if time.monotonic() > deadline:
            raise DaemonError(
                f"spswapd did not answer on {cfg.paths.socket} in time; see {log_path(cfg)}"
            )
        time.sleep(0.01)


def _exited(pid: int) -> bool:
    try:
        done, _status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return not Path(f"/proc/{pid}").exists()
    return done == pid


def daemon_argv() -> list[str]:
    """The command that runs the daemon in the foreground."""
    return [sys.executable, "-m", "spswap.daemon"]


def start(cfg: Config, wait_s: float = 10.0) -> int:
    """Start the daemon detached from the caller (safe from a Slurm prolog); its pid
    (-1: root's daemon runs, seen by a user, who may not read its pid; a user may not
    start root's: :class:`PermissionDenied`).

    Two callers racing are serialised by a start lock; the loser finds the winner's
    daemon. Raises :class:`DaemonError` (naming the log) when it does not come up.
    """
    deadline = time.monotonic() + wait_s
    # root's daemon as a user sees it (its pid file not readable): it runs. Root goes on to
    # prepare_dirs (which checks the tree is root's) and waits under the start lock: a
    # pid file it can read but not parse is one being written right now
    running = daemon_running(cfg) if os.geteuid() != 0 else None
    if running is not None and running < 0:
        return running
    prepare_dirs(cfg)
    try:
        lock_fd = os.open(cfg.paths.run / START_LOCK,
                          os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)  # fmt: skip
    except PermissionError:
        if os.geteuid() == 0:
            raise
        raise PermissionDenied(
            f"spswapd for {cfg.root} is root's and is not running: only "
            "root starts it (the Slurm prolog does at a job's start; "
            "`sudo spswap daemon start`, or ask the node's admin)"
        ) from None
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        running = daemon_running(cfg)
        if running:
            return _wait_ready(cfg, None, deadline)
        pid = _spawn_detached(cfg)
        return _wait_ready(cfg, pid, deadline)
    finally:
        os.close(lock_fd)


DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def daemon_env(caller_env: Mapping[str, str], cfg: Config, code_dir: str | None) -> dict[str, str]:
    """The environment spswapd starts with: none of its caller's but the settings.

    The first caller is often a job's prolog, whose environment is that job's
    (``SLURM_JOB_ID``, ``SLURM_JOB_UID``, ``CUDA_VISIBLE_DEVICES``): a daemon that kept it
    would see one job's GPUs as the node's and take job 1's id for its own. It keeps the
    ``SPSWAP_*`` settings (the hooks read them from the settings file; the daemon reads
    that file again itself), ``PATH`` (where criu and Slurm's commands are; the hooks
    set a fixed one), ``LANG``, and a ``HOME`` of its own user's. ``code_dir``: the
    directory the running spswap is imported from, when the interpreter would not find
    it by itself (a checkout), so the daemon runs the code that started it."""
    import pwd

    env = {k: v for k, v in caller_env.items() if k.startswith("SPSWAP_")}
    env["SPSWAP_ROOT"] = str(cfg.root)
    env["PATH"] = caller_env.get("PATH") or DEFAULT_PATH
    if caller_env.get("LANG"):
        env["LANG"] = caller_env["LANG"]
    try:
        env["HOME"] = pwd.getpwuid(os.geteuid()).pw_dir
    except KeyError:
        env["HOME"] = "/"
    if code_dir:
        env["PYTHONPATH"] = code_dir
    return env


def _code_dir() -> str | None:
    """Where this spswap is imported from, unless the interpreter finds it there anyway."""
    import site

    here = str(Path(__file__).resolve().parents[2])
    known = {str(Path(p).resolve()) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    return None if here in known else here


def _spawn_detached(cfg: Config) -> int:
    import subprocess

    env = daemon_env(os.environ, cfg, _code_dir())
    log_fd = os.open(log_path(cfg), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                     | os.O_NOFOLLOW, 0o644)  # fmt: skip
    try:
        proc = subprocess.Popen(
            daemon_argv(), stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
            start_new_session=True, close_fds=True, cwd="/", env=env,
        )  # fmt: skip
    finally:
        os.close(log_fd)
    # Popen returns after the child's exec; setsid ran before it. Check anyway: the
    # prolog must not exit while the daemon is still in its process group.
    deadline = time.monotonic() + 2.0
    while os.getsid(proc.pid) != proc.pid:
        if time.monotonic() > deadline:
            raise DaemonError(f"spswapd (pid {proc.pid}) did not leave the caller's session")
        time.sleep(0.001)
    proc.returncode = 0  # never reap it from here: it outlives us (silences Popen.__del__)
    return proc.pid


def prepare_dirs(cfg: Config) -> None:
    """Create root, run and log directories (0755: users traverse run/ to the socket).

    As root, claim the root directory (one another user made is moved aside) and make
    and check the tree from verified directory descriptors, refusing one another user
    could have prepared (see :mod:`spswap.daemon.tree`). Past this, no user can change
    anything in the tree, so the daemon's later opens by path are safe.
    """
    if os.geteuid() != 0:  # a user's private daemon: the user's own business
        for d in (cfg.root, cfg.paths.run, cfg.paths.log):
            d.mkdir(parents=True, exist_ok=True, mode=0o755)
        if cfg.paths.run.stat().st_uid == os.geteuid():
            os.chmod(cfg.paths.run, 0o755)
        return
    from spswap.daemon import tree

    aside = tree.prepare(cfg.root)
    if aside is not None:
        moved = cfg.root.with_name(aside)
        sys.stderr.write(f"spswapd: {cfg.root} was not root's; moved it to {moved}\n")
        from spswap.daemon import events

        events.append(cfg.paths.events, "root.quarantined", moved_to=str(moved))


def stop(cfg: Config, timeout_s: float = 10.0) -> int | None:
    """Stop the daemon (SIGTERM, then SIGKILL after ``timeout_s``); the pid it had, or
    None when none runs. A user, who may not read root's pid file, is refused
    (:class:`PermissionDenied`): she was told "not running" of a daemon that ran."""
    pid = daemon_running(cfg)
    if pid is not None and pid < 0:
        raise PermissionDenied(f"spswapd runs for {cfg.root} as root: only root stops it "
                               "(`sudo spswap daemon stop`, or ask the node's admin)")  # fmt: skip
    if not pid:
        return None
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return pid
    deadline = time.monotonic() + timeout_s
    while daemon_running(cfg):
        if time.monotonic() > deadline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 5.0
        _exited(pid)
        time.sleep(0.01)
    return pid


def ensure(cfg: Config, wait_s: float = 10.0) -> int:
    """The running daemon's pid, starting it first when needed; fast when it runs. A user
    sees root's daemon as running without its pid (-1): that is it running too (the walk:
    a user's `spswap daemon ensure` tried to start a second one and failed on its lock)."""
    pid = daemon_running(cfg)
    if pid and ping(cfg):
        return pid
    return start(cfg, wait_s=wait_s)
