"""The command lines spswap runs CRIU with: pure functions, pinned by golden tests.

Flags, and why:
- ``--shell-job`` when the process is not a session leader (not started with setsid).
- ``--tcp-close`` drops established TCP connections (clients reconnect); without it CRIU
  refuses to dump them.
- ``--ext-unix-sk`` lets CRIU dump Unix sockets whose peer is outside the tree; a *connected
  stream* socket to an outside peer still fails, so the engine closes those before a dump.
- ``--ghost-limit`` raises the size up to which mapped-then-deleted files are copied into
  the image.
- ``--restore-detached`` makes the restored tree a child of init, not of the caller; with
  ``--pidfile`` the caller still learns its pid.
- ``-v4 -o LOG`` keeps a full log inside the image directory: CRIU's own exit status says
  little, the log says why.
- ``--unprivileged``, started through ``setpriv`` as the job's user with only the
  capabilities that mode needs (:func:`as_user_argv`): the kernel's own permission checks
  then apply to every path CRIU opens, and a node whose root lacks CAP_SYS_RESOURCE (CRIU
  as root cannot read another uid's rlimits there) can still dump a user's process.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

LOG_VERBOSITY = "-v4"
_VERSION_RE = re.compile(r"^\s*Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", re.MULTILINE)


# checkpoint_restore and sys_ptrace for the dump; setpcap for the restore (its restorer
# drops capabilities from the bounding set the image lists).
UNPRIVILEGED_CAPS = "+checkpoint_restore,+sys_ptrace,+setpcap"


# The kernel kills CRIU when the thread that started it ends (spswapd killed mid-dump):
# an orphaned CRIU would hold the tree seized. Last of setpriv's options: a change of
# credentials clears it, and setpriv sets it after its own.
DIE_WITH_CALLER = "--pdeathsig=KILL"

# setpriv sets the death signal only after its fork: a caller killed before that leaves
# CRIU orphaned all the same (a CI run: spswapd killed just as its dump began, CRIU held
# the tree for minutes). So, once the signal is set, a shell goes on to CRIU only while
# its parent is still the caller ($0 here); else it ends. The exec keeps the pid and the
# signal (no new credentials).
ONLY_UNDER_CALLER = (
    '[ "$PPID" = "$0" ] && exec "$@"; '
    'echo "spswap: the caller ended before CRIU started" >&2; exit 1'
)
SHELL = "/bin/sh"


def caller_guard(caller_pid: int) -> list[str]:
    """What comes after ``setpriv``'s options: CRIU starts only under ``caller_pid``.

    >>> caller_guard(42)[:2] + caller_guard(42)[3:]
    ['/bin/sh', '-c', '42']
    """
    return [SHELL, "-c", ONLY_UNDER_CALLER, str(caller_pid)]


def as_root_argv(setpriv: str, caller_pid: int) -> list[str]:
    """The ``setpriv`` prefix of root's CRIU (dump or restore): it dies with its caller,
    ``caller_pid`` (:func:`caller_guard`).

    >>> as_root_argv("setpriv", 42)[:3]
    ['setpriv', '--pdeathsig=KILL', '/bin/sh']
    """
    return [setpriv, DIE_WITH_CALLER, *caller_guard(caller_pid)]


def as_user_argv(setpriv: str, *, uid: int, gid: int, groups: list[int],
                 caller_pid: int) -> list[str]:  # fmt: skip
    """The ``setpriv`` prefix that starts CRIU as ``uid``/``gid`` with ``groups`` and
    ambient :data:`UNPRIVILEGED_CAPS` (inheritable too: ambient needs them there); it
    dies with its caller, ``caller_pid`` (:data:`DIE_WITH_CALLER`, :func:`caller_guard`).

    >>> as_user_argv("setpriv", uid=1001, gid=1001, groups=[], caller_pid=42)[:4]
    ['setpriv', '--reuid=1001', '--regid=1001', '--clear-groups']
    """
    if uid <= 0:
        raise ValueError(f"CRIU as a user needs a non-root uid, got {uid}")
    argv = [setpriv, f"--reuid={uid}", f"--regid={gid}"]
    argv.append(f"--groups={','.join(str(g) for g in groups)}" if groups else "--clear-groups")
    return argv + [f"--inh-caps={UNPRIVILEGED_CAPS}", f"--ambient-caps={UNPRIVILEGED_CAPS}",
                   DIE_WITH_CALLER, *caller_guard(caller_pid)]  # fmt: skip


def check_argv(criu: str) -> list[str]:
    """``criu check``: does this kernel support what a dump and a restore need."""
    return [criu, "check"]


def version_argv(criu: str) -> list[str]:
    """``criu --version``: prints ``Version: X.Y[.Z]``."""
    return [criu, "--version"]


def dump_argv(
    criu: str,
    *,
    pid: int,
    images_dir: Path,
    log_file: str = "dump.log",
    leave_running: bool = False,
    shell_job: bool,
    tcp_close: bool = False,
    ghost_limit_bytes: int | None = None,
    ext_unix_sk: bool = False,
    link_remap: bool = False,
    action_script: Path | None = None,
    unprivileged: bool = False,
    freeze_cgroup: str | None = None,
) -> list[str]:
    """``criu dump`` of the tree rooted at ``pid`` into ``images_dir``.

    ``log_file`` is relative to ``images_dir`` (CRIU writes it there with ``-D``).
    ``action_script``: run by CRIU at each stage (see :func:`post_dump_script`).
    ``freeze_cgroup``: the cgroup the tree waits in, frozen (``freeze_hold``): CRIU
    seizes its tasks before it thaws them, and freezes them again when it lets go.
    """
    if pid <= 0:
        raise ValueError(f"pid must be positive, got {pid}")
    argv = [criu, "dump", "--tree", str(pid), "--images-dir", str(images_dir)]
    argv += [LOG_VERBOSITY, "--log-file", log_file]
    if unprivileged:
        argv.append("--unprivileged")
    if leave_running:
        argv.append("--leave-running")
    if shell_job:
        argv.append("--shell-job")
    if tcp_close:
        argv.append("--tcp-close")
    if ext_unix_sk:
        argv.append("--ext-unix-sk")
    if link_remap:
        argv.append("--link-remap")
    if action_script is not None:
        argv += ["--action-script", str(action_script)]
    if freeze_cgroup is not None:
        argv += ["--freeze-cgroup", freeze_cgroup]
    if ghost_limit_bytes is not None:
        if ghost_limit_bytes < 0:
            raise ValueError(f"ghost_limit_bytes must be >= 0, got {ghost_limit_bytes}")
        argv += ["--ghost-limit", str(ghost_limit_bytes)]
    return argv


def restore_argv(
    criu: str,
    *,
    images_dir: Path,
    log_file: str = "restore.log",
    pidfile: Path,
    restore_detached: bool = True,
    shell_job: bool,
    tcp_close: bool = False,
    ext_unix_sk: bool = False,
    auto_dedup: bool = False,
    unprivileged: bool = False,
) -> list[str]:
    """``criu restore`` of the image in ``images_dir``; the root pid is written to ``pidfile``.

    ``auto_dedup`` frees image pages as they are restored (faster on tmpfs, but the image
    can be used only once: the caller must delete it afterwards).

    Always ``--manage-cgroups=ignore``: the tree comes back in the restorer's cgroups (and
    spswapd moves it into the new job run's); CRIU's default would re-create the cgroups it
    was dumped from (the parked one, or a job long gone) and put it there.
    """
    argv = [criu, "restore", "--images-dir", str(images_dir)]
    argv += [LOG_VERBOSITY, "--log-file", log_file, "--pidfile", str(pidfile)]
    argv.append("--manage-cgroups=ignore")
    if unprivileged:
        argv.append("--unprivileged")
    if restore_detached:
        argv.append("--restore-detached")
    if shell_job:
        argv.append("--shell-job")
    if tcp_close:
        argv.append("--tcp-close")
    if ext_unix_sk:
        argv.append("--ext-unix-sk")
    if auto_dedup:
        argv.append("--auto-dedup")
    return argv


THP_FILL_VAR = "CRIU_THP_FILL"  # read by spswap's thp-fill patch to CRIU's restore


def restore_env(base: Mapping[str, str], *, hugepages: bool) -> dict[str, str]:
    """The environment of ``criu restore``: ``base`` with :data:`THP_FILL_VAR` set to
    ``1`` where the node fills restored memory in huge pages (SPSWAP_RESTORE_HUGEPAGES),
    and removed otherwise (so that only the setting decides).

    >>> restore_env({"PATH": "/bin", "CRIU_THP_FILL": "1"}, hugepages=False)
    {'PATH': '/bin'}
    >>> restore_env({"PATH": "/bin"}, hugepages=True)
    {'PATH': '/bin', 'CRIU_THP_FILL': '1'}
    """
    env = {k: v for k, v in base.items() if k != THP_FILL_VAR}
    if hugepages:
        env[THP_FILL_VAR] = "1"
    return env


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` from ``criu --version`` output, None if absent.

    >>> parse_version("Version: 4.1.1\\n")
    (4, 1, 1)
    >>> parse_version("Version: 4.2\\nGitID: v4.2\\n")
    (4, 2, 0)
    """
    m = _VERSION_RE.search(text)
    if m is None:
        return None
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))


def post_dump_script(
    writes: list[tuple[str, str]],
    link_dirs: list[str],
    parked_prefix: str,
    root_fifos: tuple[str, str] | None = None,
) -> str:
    """The action script of a dump that leaves the tree running (spswapd's kept instances).

    CRIU runs it at every stage; at post-dump (the image is complete and the tree still
    stopped by CRIU) it
    - writes each ``(file, value)`` of ``writes``: the freeze of the tree's parked cgroup,
      so that when CRIU lets go the tree does not run a single instruction outside a job;
    - hard-links CRIU's ``link_remap.<id>`` links in ``link_dirs`` (never a symlink, and
      only names whose id is all digits, as CRIU's are: ``link_remap.6.7`` is somebody
      else's) as ``<parked_prefix><id>``: CRIU deletes its links at the end of such a
      dump (the tree still holds the files), which would leave the image unrestorable
      once the tree is gone; spswap checks these by device and inode like the links it
      renames after other dumps.
    ``root_fifos`` (request, answer): CRIU runs as the job's user, who may not write the
    freeze; the script asks root through the request FIFO and waits on the answer FIFO
    until root has made the writes (``criu_user.root_post_dump``), instead of ``writes``.
    Every other stage, and any failure, exits 0: the script must never fail the dump (the
    daemon checks the freeze itself afterwards).
    """
    import shlex

    lines = [
        "#!/bin/sh",
        "# spswap: post-dump of a dump that leaves the tree running",
        '[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0',
    ]
    if root_fifos is not None:
        req, ans = (shlex.quote(f) for f in root_fifos)
        lines += [f"echo post-dump > {req}", f"read -r _ < {ans}"]
    else:
        lines += [f"echo {shlex.quote(value)} > {shlex.quote(path)}" for path, value in writes]
    for d in link_dirs:
        q, to = shlex.quote(d), shlex.quote(f"{d}/{parked_prefix}")
        lines += [
            f"for f in {q}/link_remap.*; do",
            '  id="${f##*/link_remap.}"',
            '  case "$id" in ""|*[!0-9]*) continue;; esac',
            f'  [ -f "$f" ] && [ ! -L "$f" ] && ln -P -- "$f" {to}"$id"',
            "done",
        ]
    lines.append("exit 0")
    return "\n".join(lines) + "\n"
