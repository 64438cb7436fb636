"""Real CRIU started as the job's user (``--unprivileged``) on a second uid's process: the
dump and the restore run with that user's rights, the image is root's once complete, and
the process comes back with its pid, its uid, no capabilities and its state."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spswap.checkpoint import criu, criu_argv, image_creds
from spswap.errors import CheckpointFailed

from .criu_helpers import needs_criu

pytestmark = [pytest.mark.criu, needs_criu]

# Counts in memory and writes the count to a file: a restored process goes on from its
# own count (a restart would begin at 1 again).
COUNTER = """
import os, sys, time
n = 0
while True:
    n += 1
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(n))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(0.02)
"""


def _count(path: Path) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            return int(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.02)
    raise AssertionError(f"{path} never got a count")


def _counts_on(path: Path, above: int, timeout_s: float = 10.0) -> bool:
    """Whether the count at ``path`` goes past ``above`` within ``timeout_s`` (the counter
    ticks every few ms; a loaded machine may leave it unscheduled for a while)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _count(path) > above:
            return True
        time.sleep(0.02)
    return False


def _status(pid: int) -> dict[str, list[str]]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.split() for k, _, v in (line.partition(":") for line in lines)}


@pytest.fixture
def user_counter(user_uid: int, tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A session-leader counter running as the second uid (reparented to init, so its pid
    is free for the restore once the dump ends it)."""
    # pytest's own tmp folders are root's 0700: the user's files go where it can reach
    top = Path(tempfile.mkdtemp(prefix="spswap-criu-user-", dir="/tmp"))
    os.chmod(top, 0o755)
    work = top / "work"
    work.mkdir()
    os.chown(work, user_uid, -1)
    gid = pwd.getpwuid(user_uid).pw_gid
    # sh forks setsid'ed python and exits: python is init's child, not ours
    subprocess.run(
        ["setpriv", f"--reuid={user_uid}", f"--regid={gid}", "--clear-groups", "sh", "-c",
         'setsid /usr/bin/python3 -c "$0" "$1" </dev/null >/dev/null 2>&1 & echo $! > "$2"',
         COUNTER, str(work / "count"), str(work / "pid")],
        check=True, timeout=10,
    )  # fmt: skip
    pid = int((work / "pid").read_text())
    _count(work / "count")
    try:
        yield pid, work / "count"
    finally:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
        shutil.rmtree(top, ignore_errors=True)


def test_a_users_process_is_dumped_and_restored_by_criu_as_that_user(
    user_counter: tuple[int, Path], user_uid: int, tmp_path: Path
) -> None:
    pid, count = user_counter
    images = tmp_path / "images"
    run_as = criu.RunAs.for_uid(user_uid)
    before = _count(count)
    info = criu.dump(
        pid, "user-counter", images, run_as=run_as, owner=(user_uid, set(run_as.groups))
    )
    # the credentials the restore will give back, read from the image's own bytes
    cores = image_creds.read_cores(info.path)
    assert [c.tid for c in cores] == [pid]
    assert cores[0].creds is not None and cores[0].creds.uids == (user_uid,) * 4
    assert not any(cores[0].creds.cap_eff + cores[0].creds.cap_prm)
    # the finished image is root's alone, whoever dumped it
    assert os.stat(images).st_mode & 0o777 == 0o700
    files = list(info.path.iterdir())
    assert {p.stat().st_uid for p in files} == {0}
    assert not [p for p in files if p.stat().st_mode & 0o022], "no file writable by others"
    assert os.stat(info.path).st_uid == 0
    criu.wait_pids_free([pid], 10)
    restored = criu.restore("user-counter", images, run_as=run_as)
    assert restored == pid
    st = _status(pid)
    assert st["Uid"] == [str(user_uid)] * 4
    assert {st[k][0] for k in ("CapInh", "CapPrm", "CapEff", "CapAmb")} == {"0000000000000000"}
    after = _count(count)
    assert before <= after and _counts_on(count, after), "the restored process goes on counting"
    assert os.stat(info.path).st_uid == 0, "root takes the image back after the restore"


def test_a_restore_that_cannot_start_in_the_runs_cgroup_restores_outside_and_says_why(
    user_counter: tuple[int, Path], user_uid: int, tmp_path: Path
) -> None:
    """restore_instance's fallback (spswapd's `restore.criu_outside_job`): CRIU is to start
    in the run's cgroups and cannot (here: a cgroup that is not there); the image, which
    CRIU never touched, is restored as before, and the caller is told why."""
    from spswap.checkpoint.images import Identity
    from spswap.checkpoint.service import dump_instance, restore_instance

    pid, count = user_counter
    identity = Identity("test", "1", "-", "-", "-", "-", "4.1", "sha256:0", user_uid, "c0")
    images = count.parent.parent / "images"  # root's, reachable by the user's CRIU
    dump_instance(images, job_id="fb", pid=pid, identity=identity)
    criu.wait_pids_free([pid], 10)
    before = _count(count)
    said: list[str] = []
    gone = tmp_path / "no-such-cgroup"
    restored, _ = restore_instance(images, job_id="fb", expected=identity, check_integrity=False,
                                   cgroup_dirs=[gone], outside=said.append)  # fmt: skip
    assert restored == pid and _counts_on(count, before), "restored, it counts on"
    assert len(said) == 1 and "CRIU could not be started inside the cgroup(s)" in said[0], said
    assert str(gone) in said[0], said


def test_a_dump_as_the_user_leaves_the_tree_frozen_by_root(
    user_counter: tuple[int, Path], user_uid: int
) -> None:
    """Keeping a user's tree: CRIU as the user leaves it running, and root freezes its
    cgroup at post-dump (asked by the script through root's FIFOs) before CRIU lets go:
    the tree never counts on between the dump and the thaw."""
    pid, count = user_counter
    freezer = Path("/sys/fs/cgroup/freezer")
    if not (freezer / "cgroup.procs").exists():
        pytest.skip("needs a cgroup v1 freezer (the CI machines have one)")
    group = freezer / f"spswap-test-keep-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cgroup.procs").write_text(str(pid))
        images = count.parent.parent / "images"  # its parent: root's, reachable by the user
        info = criu.dump(pid, "kept-user", images, run_as=criu.RunAs.for_uid(user_uid),
                         leave_running=True,
                         post_dump_writes=[(group / "freezer.state", "FROZEN")])  # fmt: skip
        assert (group / "freezer.state").read_text().strip() == "FROZEN"
        assert Path(f"/proc/{pid}").exists() and (info.path / "inventory.img").exists()
        frozen_at = _count(count)
        time.sleep(0.3)
        assert _count(count) == frozen_at, "the kept tree ran after its dump"
        assert not list(images.parent.glob(".postdump-*")), "root's FIFO folder is removed"
        (group / "freezer.state").write_text("THAWED")
        assert _counts_on(count, frozen_at), "thawed, it goes on from where it was"
    finally:
        (group / "freezer.state").write_text("THAWED")
        for p in (group / "cgroup.procs").read_text().split():
            (freezer / "cgroup.procs").write_text(p)
        group.rmdir()


def test_an_image_root_dumped_is_not_restored_as_a_user(tmp_path: Path, user_uid: int) -> None:
    image = tmp_path / "images" / "img"
    image.mkdir(parents=True)
    (image / criu.DUMP_META).write_text('{"pid": 4242, "pids": [4242]}')
    with pytest.raises(CheckpointFailed, match="not dumped by CRIU as uid"):
        criu.restore("img", tmp_path / "images", run_as=criu.RunAs.for_uid(user_uid))


GUARD = ["/bin/sh", "-c", '[ "$PPID" = "$0" ] && exec "$@"; echo "spswap: the caller ended '
         'before CRIU started" >&2; exit 1', "4242"]  # fmt: skip


def test_the_setpriv_prefix() -> None:
    assert criu_argv.as_user_argv("/usr/bin/setpriv", uid=1001, gid=100, groups=[100, 27],
                                  caller_pid=4242) == [
        "/usr/bin/setpriv", "--reuid=1001", "--regid=100", "--groups=100,27",
        "--inh-caps=+checkpoint_restore,+sys_ptrace,+setpcap",
        "--ambient-caps=+checkpoint_restore,+sys_ptrace,+setpcap", "--pdeathsig=KILL", *GUARD,
    ]  # fmt: skip
    assert criu_argv.as_root_argv("/usr/bin/setpriv", 4242) == [
        "/usr/bin/setpriv", "--pdeathsig=KILL", *GUARD]  # fmt: skip
    with pytest.raises(ValueError):
        criu_argv.as_user_argv("setpriv", uid=0, gid=0, groups=[], caller_pid=1)


@pytest.mark.parametrize("caller", ["alive", "ended"])
def test_criu_starts_only_while_its_caller_lives(tmp_path: Path, caller: str) -> None:
    """The guard after setpriv's death signal: a caller that ended before it was set
    (here: a pid that is not the parent) gets no CRIU at all; the real parent gets its
    command run with its own pid (exec) and the death signal kept."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv is not installed (util-linux)")
    parent = os.getpid() if caller == "alive" else 1
    # stands in for CRIU: its pid, its parent's and its death signal (PR_GET_PDEATHSIG)
    probe = ("import ctypes, os; sig = ctypes.c_int(); "
             "ctypes.CDLL(None).prctl(2, ctypes.byref(sig)); "
             "print(os.getpid(), os.getppid(), sig.value)")  # fmt: skip
    proc = subprocess.Popen([*criu_argv.as_root_argv(setpriv, parent), sys.executable, "-c",
                             probe], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    out, err = proc.communicate(timeout=30)
    if caller == "ended":
        assert (proc.returncode, out) == (1, ""), (proc.returncode, out, err)
        assert err == "spswap: the caller ended before CRIU started\n"
    else:
        assert proc.returncode == 0, err
        assert out.split() == [str(proc.pid), str(os.getpid()), str(int(signal.SIGKILL))]
