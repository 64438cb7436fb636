"""``spswap doctor``'s CRIU checks that need a real dump: a short-lived process of another
uid dumped and restored the way spswapd dumps a job's (CRIU as that user in
``--unprivileged`` mode, frozen for the credential check, the image's credentials read
back; root's CRIU too when the site setting SPSWAP_CRIU_AS_ROOT=1 selects it), and what
the kernel or the GPU stack lacks for the unprivileged mode. ``criu check`` passing says
little: on a node whose root lacks CAP_SYS_RESOURCE it passes while every dump of a
user's process fails ("Can't get rlimit").

The judging of what was found is pure (:func:`unprivileged_kernel_check`,
:func:`gpu_nodes_check`, :func:`test_dump_check`) and tested on exact values.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from spswap.checkpoint import criu
from spswap.checkpoint.credentials import dump_frozen
from spswap.checkpoint.criu_log import CAP_SYS_RESOURCE_FIX, first_error
from spswap.config import Config
from spswap.doctor_check import check
from spswap.errors import CheckpointFailed, SpswapError

CAP_CHECKPOINT_RESTORE = 40  # Linux >= 5.9
TEST_USERS = ("nobody", "daemon")  # a uid of the node's own, never a real user's


def unprivileged_kernel_check(cap_last_cap: int | None) -> dict[str, Any]:
    """CRIU as the job's user needs CAP_CHECKPOINT_RESTORE (Linux >= 5.9): the kernel's
    highest capability number (/proc/sys/kernel/cap_last_cap) says whether it has it."""
    name = "criu as the user: kernel"
    if cap_last_cap is None:
        return check(name, None, "cap_last_cap unreadable", "the test dump below tells")
    if cap_last_cap >= CAP_CHECKPOINT_RESTORE:
        return check(name, True, "CAP_CHECKPOINT_RESTORE known (Linux >= 5.9)")
    return check(name, False, f"no CAP_CHECKPOINT_RESTORE (cap_last_cap {cap_last_cap})",
                 "this kernel refuses CRIU's --unprivileged mode (it needs Linux >= 5.9): "
                 "upgrade the kernel, or set SPSWAP_CRIU_AS_ROOT=1 where users are trusted "
                 "(root's CRIU then restores; see docs/slurm.md, Known gaps)",
                 required=True)  # fmt: skip


def gpu_nodes_check(nodes: dict[str, int]) -> dict[str, Any] | None:
    """A process restored by CRIU as the job's user reopens the GPU's device files with
    that user's rights: ``nodes`` (path -> mode) that others may not read and write
    refuse it (a restore then fails where a root restore would not). None without GPUs."""
    if not nodes:
        return None
    name = "criu as the user: GPU device files"
    closed = sorted(p for p, mode in nodes.items() if mode & 0o006 != 0o006)
    if not closed:
        return check(name, True, f"{len(nodes)} /dev/nvidia* files open to users")
    return check(name, None, f"not open to every user: {', '.join(closed)}",
                 "a restore by CRIU as the job's user reopens these with the user's rights: "
                 "give the job's users access (the driver's default mode is 0666; Slurm's "
                 "device cgroup still limits each job to its GPUs)")  # fmt: skip


def test_dump_check(way: str, uid: int, user: str, error: str | None, seconds: float,
                    required: bool) -> dict[str, Any]:  # fmt: skip
    """The test dump's row: ``way`` "as the user" or "as root"; ``error``: the first line
    of the dump's or restore's error, None when it came back with its uid and no
    capabilities."""
    name = f"criu test dump {way}"
    if error is None:
        return check(name, True, f"dumped and restored a process of {user} (uid {uid}) in "
                     f"{seconds:.2f} s", required=required)  # fmt: skip
    detail = ("every job's checkpoint fails the same way: " if required else
              "not the site's setting (SPSWAP_CRIU_AS_ROOT), shown for comparison: ")  # fmt: skip
    return check(name, False if required else None, error, detail + _lacks(error),
                 required=required)  # fmt: skip


def _lacks(error: str) -> str:
    """What the node lacks, judged from the dump's first error."""
    if "Can't get rlimit" in error:
        return CAP_SYS_RESOURCE_FIX
    if "CAP_CHECKPOINT_RESTORE" in error or "unprivileged" in error.lower():
        return ("the kernel refuses CRIU's --unprivileged mode (CAP_CHECKPOINT_RESTORE, "
                "Linux >= 5.9); set SPSWAP_CRIU_AS_ROOT=1 only where users are "
                "trusted")  # fmt: skip
    if "setpriv" in error:
        return "install util-linux's setpriv (root starts CRIU as the job's user with it)"
    return "see the error; `spswap doctor --json` has it whole"


def _test_user() -> tuple[int, int, str] | None:
    for name in TEST_USERS:
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            continue
        if pw.pw_uid != 0:
            return pw.pw_uid, pw.pw_gid, name
    return None


def _dump_and_restore(uid: int, gid: int, as_user: bool) -> tuple[str | None, float]:
    """Dump a sleeping process of ``uid`` by spswapd's own path and restore it; (the
    first line of what failed or None, seconds)."""
    top = Path(tempfile.mkdtemp(prefix="spswap-doctor-"))  # root's, 0700
    setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
    proc = None
    restored = None
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen([setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                                 "sleep", "60"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, cwd="/")  # fmt: skip
        _wait_exec(proc.pid, uid)
        run_as = criu.RunAs.for_uid(uid) if as_user else None
        dump_frozen(proc.pid, "doctor", top, uid, criu_path=None, keep=False, writes=None,
                    run_as=run_as, freeze_tag="doctor")  # fmt: skip
        proc.wait(10)  # CRIU ended it; its pid must be free for the restore
        restored = criu.restore("doctor", top, run_as=run_as)
        status = Path(f"/proc/{restored}/status").read_text()
        fields = {k: v.split() for k, _, v in (ln.partition(":") for ln in status.splitlines())}
        if fields.get("Uid") != [str(uid)] * 4 or int(fields["CapEff"][0], 16):
            return f"the restored process has uids {fields.get('Uid')}", time.monotonic() - t0
        return None, time.monotonic() - t0
    except CheckpointFailed as e:  # CRIU's own first error says what the node lacks
        step = "restore" if proc is not None and proc.poll() is not None else "dump"
        first = first_error("\n".join(e.log_tail))
        what = f"criu {step}: {first}" if first else str(e).splitlines()[0][:300]
        return what, time.monotonic() - t0
    except (SpswapError, OSError, subprocess.SubprocessError) as e:
        return str(e).splitlines()[0][:300], time.monotonic() - t0
    finally:
        for pid in (restored, proc.pid if proc else None):
            if pid:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        if proc is not None:
            proc.wait(10)
        shutil.rmtree(top, ignore_errors=True)


def _wait_exec(pid: int, uid: int, timeout_s: float = 5.0) -> None:
    """Until setpriv has become ``sleep`` as ``uid``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "sleep" and \
                    os.stat(f"/proc/{pid}").st_uid == uid:  # fmt: skip
                return
        except OSError:
            pass
        time.sleep(0.01)
    raise OSError(f"the test process {pid} did not start as uid {uid}")


def _cap_last_cap() -> int | None:
    try:
        return int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        return None


def _gpu_nodes() -> dict[str, int]:
    out = {}
    for p in sorted(Path("/dev").glob("nvidia*")):
        try:
            st = p.stat()
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            out[str(p)] = st.st_mode & 0o777
    return out


def checks(cfg: Config, criu_usable: bool) -> list[dict[str, Any]]:
    """The unprivileged mode's kernel and GPU checks, and the test dumps (root only, with
    a usable CRIU): as the user always (the default path: required unless the site
    setting selects root's CRIU), as root when SPSWAP_CRIU_AS_ROOT=1 (then required)."""
    out = [unprivileged_kernel_check(_cap_last_cap())]
    gpu = gpu_nodes_check(_gpu_nodes())
    if gpu is not None:
        out.append(gpu)
    if not criu_usable:
        return out
    if os.geteuid() != 0:
        out.append(check("criu test dump", None, "not run",
                         "needs root: run `sudo spswap doctor`"))  # fmt: skip
        return out
    user = _test_user()
    if user is None:
        users = " or ".join(TEST_USERS)
        out.append(check("criu test dump", None, "not run",
                         f"no user {users} to test-dump a process of"))  # fmt: skip
        return out
    uid, gid, name = user
    error, seconds = _dump_and_restore(uid, gid, as_user=True)
    out.append(test_dump_check("as the user", uid, name, error, seconds,
                               required=not cfg.criu_as_root))  # fmt: skip
    if cfg.criu_as_root:
        error, seconds = _dump_and_restore(uid, gid, as_user=False)
        out.append(test_dump_check("as root", uid, name, error, seconds, required=True))
    return out
