"""Parking a tree outside its job's cgroups: the parsers on exact text, and the real
moves on this machine's cgroupfs (root; a job cgroup made by the test plays Slurm's)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spswap.checkpoint import cgroups
from spswap.checkpoint.cgroups import Membership, Mount, memberships

HYBRID_CGROUP = """\
9:name=systemd:/
6:freezer:/slurm_vm/uid_0/job_317/step_batch
4:memory:/process_api/c5ef
2:cpu,cpuacct:/
0::/
"""

HYBRID_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 /process_api /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
22 1 0:21 / /proc rw,nosuid - proc proc rw
"""


def test_parse_proc_cgroup() -> None:
    assert cgroups.parse_proc_cgroup(HYBRID_CGROUP) == [
        Membership("name=systemd", "/"),
        Membership("freezer", "/slurm_vm/uid_0/job_317/step_batch"),
        Membership("memory", "/process_api/c5ef"),
        Membership("cpu,cpuacct", "/"),
        Membership("", "/"),
    ]


def test_parse_mountinfo_and_paths() -> None:
    mounts = cgroups.parse_mountinfo(HYBRID_MOUNTINFO)
    assert mounts == [
        Mount("cpu,cpuacct", "/", "/sys/fs/cgroup/cpu,cpuacct"),
        Mount("memory", "/process_api", "/sys/fs/cgroup/memory"),
        Mount("freezer", "/", "/sys/fs/cgroup/freezer"),
        Mount("name=systemd", "/", "/sys/fs/cgroup/systemd"),
        Mount("", "/", "/sys/fs/cgroup/unified"),
    ]
    path = cgroups.fs_path
    assert path(Membership("freezer", "/slurm/job_1"), mounts) == Path(
        "/sys/fs/cgroup/freezer/slurm/job_1"
    )
    assert path(Membership("memory", "/process_api/c5ef"), mounts) == Path(
        "/sys/fs/cgroup/memory/c5ef"
    )  # a mount of part of the hierarchy
    assert path(Membership("memory", "/elsewhere"), mounts) is None  # not visible here
    assert path(Membership("", "/system.slice/x.service"), mounts) == Path(
        "/sys/fs/cgroup/unified/system.slice/x.service"
    )
    assert path(Membership("pids", "/"), mounts) is None  # not mounted


def _writable_hierarchy() -> tuple[str, Path] | None:
    """A hierarchy where this process may make child cgroups: (controllers, own dir)."""
    if os.geteuid() != 0:
        return None
    for controllers, own in cgroups.own_dirs(cgroups.mounts()).items():
        probe = own / f"spswap-probe-{os.getpid()}"
        try:
            probe.mkdir()
            probe.rmdir()
        except OSError:
            continue
        return controllers, own
    return None


HIERARCHY = _writable_hierarchy()
needs_cgroups = pytest.mark.skipif(
    HIERARCHY is None, reason="needs root and a writable freezer or v2 cgroupfs"
)

TREE = """
import os, signal, sys, time
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])  # before the fork: no race
if os.fork() == 0:  # a child in the tree
    if len(sys.argv) > 1:  # on request, on SIGUSR1, one that leaves the tree (double fork)
        signal.sigwait([signal.SIGUSR1])
        if os.fork() == 0:
            os.setsid()
            time.sleep(300)
        os._exit(0)
    time.sleep(300)
    os._exit(0)
time.sleep(300)
"""


@contextlib.contextmanager
def stand_in_job_cgroup(name: str) -> Iterator[Path]:
    """A cgroup beside this test's own (and spswapd's), as Slurm's job cgroup would be;
    whatever is left in it is killed and it is removed afterwards. Skips the test where
    no such cgroup can be made."""
    if HIERARCHY is None:
        pytest.skip("needs root and a writable freezer or v2 cgroupfs")
    job = HIERARCHY[1] / f"{name}-{os.getpid()}"
    job.mkdir()
    try:
        yield job
    finally:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for pid in (job / "cgroup.procs").read_text().split():
                os.kill(int(pid), signal.SIGKILL)
            try:
                job.rmdir()
                break
            except OSError:
                time.sleep(0.05)


@pytest.fixture
def job_cgroup() -> Iterator[Path]:
    with stand_in_job_cgroup("spswap-test-job") as job:
        yield job


def _start_in(job: Path, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", TREE, *args],
        preexec_fn=lambda: (job / "cgroup.procs").write_text(str(os.getpid())),
    )
    deadline = time.monotonic() + 10
    from spswap.checkpoint.proctree import process_tree_pids

    while len(process_tree_pids(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(process_tree_pids(proc.pid)) >= 2, f"the tree under pid {proc.pid} never grew"
    return proc


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whatever reaps here)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def _where(pid: int) -> str:
    assert HIERARCHY is not None
    return next(m.path for m in cgroups.memberships(pid) if m.controllers == HIERARCHY[0])


@needs_cgroups
def test_a_parked_tree_survives_its_job_and_leftovers_are_ended(job_cgroup: Path) -> None:
    from spswap.checkpoint.proctree import process_tree_pids

    proc = _start_in(job_cgroup)
    parking = None
    try:
        pids = process_tree_pids(proc.pid)
        assert all(_where(p).endswith(job_cgroup.name) for p in pids)
        parking = cgroups.Parking.create("t1", proc.pid)
        assert parking is not None and list(parking.dirs) == [HIERARCHY[0]]
        parking.adopt(pids)
        assert all(_where(p).endswith("spswap-parked-t1") for p in pids)
        assert parking.pids() == set(pids)
        # Slurm ends the job: everything in its cgroup (nothing of the tree any more)
        assert (job_cgroup / "cgroup.procs").read_text().split() == []
        assert proc.poll() is None
        assert sorted(parking.kill_all()) == sorted(pids)
        proc.wait(timeout=5)
        parking.remove()
        assert not parking.dirs[HIERARCHY[0]].exists()
    finally:
        if parking is not None:
            parking.kill_all()
            parking.remove()
        proc.kill()


@needs_cgroups
def test_what_the_tree_forks_after_parking_cannot_escape(job_cgroup: Path) -> None:
    from spswap.checkpoint.proctree import process_tree_pids

    parking = cgroups.Parking.create("t2", os.getpid())  # this test is in no job cgroup
    assert parking is None
    proc = _start_in(job_cgroup, "escape")
    parking = cgroups.Parking.create("t2", proc.pid)
    assert parking is not None
    try:
        before = process_tree_pids(proc.pid)
        parking.adopt(before)
        os.kill(before[1], signal.SIGUSR1)  # the child double-forks now, parked
        deadline = time.monotonic() + 5
        # the grandchild has left the tree once its parent (the child) exited
        while not (escaped := parking.pids() - set(process_tree_pids(proc.pid))) \
                and time.monotonic() < deadline:  # fmt: skip
            time.sleep(0.02)
        assert escaped
        parking.kill_all()
        assert not any(_running(p) for p in escaped)
    finally:
        parking.kill_all()
        parking.remove()
        proc.kill()


@needs_cgroups
def test_a_failed_dump_sends_the_tree_home_and_join_moves_a_restored_one(
    job_cgroup: Path,
) -> None:
    from spswap.checkpoint.proctree import process_tree_pids

    proc = _start_in(job_cgroup)
    parking = cgroups.Parking.create("t3", proc.pid)
    assert parking is not None
    outside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        pids = process_tree_pids(proc.pid)
        parking.adopt(pids)
        assert parking.return_home() == []
        assert all(_where(p).endswith(job_cgroup.name) for p in pids)
        assert parking.pids() == set()
        # a restored process (spswapd's child, here this test's) joins the job's run
        assert cgroups.join([outside.pid], memberships(proc.pid)) == [HIERARCHY[0] or "v2"]
        assert _where(outside.pid).endswith(job_cgroup.name)
        assert cgroups.join([outside.pid], memberships(proc.pid)) == []  # already there
    finally:
        parking.remove()
        outside.kill()
        outside.wait()
        proc.kill()


@needs_cgroups
def test_start_up_sweeps_what_a_dead_daemon_left_parked() -> None:
    assert HIERARCHY is not None
    tag = cgroups.root_tag(Path(f"/tmp/root-{os.getpid()}"))
    left = HIERARCHY[1] / f"{cgroups.PREFIX}{tag}-7-{os.getpid()}"
    other = HIERARCHY[1] / f"{cgroups.PREFIX}{cgroups.root_tag(Path('/other'))}-7-{os.getpid()}"
    other.mkdir()  # another daemon's (tests run several on one host): not touched
    left.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)"],
        preexec_fn=lambda: (left / "cgroup.procs").write_text(str(os.getpid())),
    )
    try:
        deadline = time.monotonic() + 5
        while not (left / "cgroup.procs").read_text().split() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert cgroups.sweep(tag) == [str(left)]
        # Ended within seconds of a 300 s sleep: reaped here with SIGKILL's status, or
        # already by kill_cgroups (it reaps its caller's children, as spswapd's restores
        # are; Popen then finds no child and reports 0). Which one is a race.
        assert proc.wait(timeout=10) in (-signal.SIGKILL, 0) and not left.exists()
        assert other.exists()
    finally:
        proc.kill()
        other.rmdir()


TICKER = """
import sys, time
while True:
    with open(sys.argv[1], "a") as f:
        f.write("x")
    time.sleep(0.005)
"""


@needs_cgroups
def test_a_frozen_parked_tree_does_not_run_until_thawed_and_can_be_ended(
    job_cgroup: Path,
    tmp_path: Path,
) -> None:
    """What a tree kept alive after its dump waits in: frozen outside its job."""
    ticks = tmp_path / "ticks"
    proc = subprocess.Popen([sys.executable, "-c", TICKER, str(ticks)],
                            preexec_fn=lambda: (job_cgroup / "cgroup.procs").write_text(
                                str(os.getpid())))  # fmt: skip
    parking = None
    try:
        deadline = time.monotonic() + 10
        while not ticks.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        parking = cgroups.Parking.create("t5", proc.pid)
        assert parking is not None
        parking.adopt([proc.pid])
        assert parking.freeze()
        frozen_at = ticks.stat().st_size
        time.sleep(0.3)
        assert ticks.stat().st_size == frozen_at, "a frozen tree ran"
        assert parking.thaw()
        deadline = time.monotonic() + 5
        while ticks.stat().st_size == frozen_at and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ticks.stat().st_size > frozen_at, "the thawed tree did not run again"
        assert parking.freeze()
        assert parking.kill_all() == [proc.pid]  # ended while frozen
        assert not _running(proc.pid)  # (kill_all reaps its caller's children itself)
    finally:
        if parking is not None:
            parking.kill_all()
            parking.remove()
        proc.kill()


def test_freeze_without_a_freezer_says_so(tmp_path: Path) -> None:
    assert cgroups.Parking("none", {"memory": tmp_path}).freeze() is False


def test_in_job_reads_slurms_job_cgroup_names() -> None:
    from spswap.checkpoint.cgroup_paths import in_job, parse_proc_cgroup

    v2 = parse_proc_cgroup("0::/system.slice/slurmstepd.scope/job_77/step_batch/user/task_0\n")
    assert in_job(v2, "77") and not in_job(v2, "7") and not in_job(v2, "770")
    v1 = parse_proc_cgroup("12:freezer:/slurm/uid_1000/job_77/step_0\n"
                           "5:memory:/user.slice\n0::/user.slice/session-3.scope\n")  # fmt: skip
    assert in_job(v1, "77")
    login = parse_proc_cgroup("12:freezer:/\n4:memory:/slurm/job_77\n0::/user.slice/s.scope\n")
    assert not in_job(login, "77"), "only the hierarchies Slurm tracks jobs by count"


def test_the_jobs_cgroup_is_cut_at_its_name_and_must_be_roots(tmp_path: Path) -> None:
    from spswap.checkpoint.cgroup_paths import (
        in_job,
        in_slurm_job,
        job_memberships,
        parse_mountinfo,
        parse_proc_cgroup,
    )

    found = parse_proc_cgroup("12:freezer:/slurm/uid_1000/job_77/step_0\n"
                              "0::/system.slice/slurmstepd.scope/job_77/step_0\n")  # fmt: skip
    assert job_memberships(found, "77") == [
        Membership("freezer", "/slurm/uid_1000/job_77"),
        Membership("", "/system.slice/slurmstepd.scope/job_77"),
    ]
    # a stand-in v2 mount: the job's folder as Slurm makes it (root's all the way up), and
    # one of the same name in a user's delegated cgroup
    mounts = parse_mountinfo(f"30 25 0:26 / {tmp_path} rw - cgroup2 cgroup2 rw\n")
    (tmp_path / "system.slice" / "slurmstepd.scope" / "job_77").mkdir(parents=True)
    assert in_slurm_job(found, "77", mounts)
    deleg = tmp_path / "user.slice" / "user@1000.service"
    (deleg / "job_77").mkdir(parents=True)
    os.chown(deleg, 1000, 1000)
    fake = parse_proc_cgroup("0::/user.slice/user@1000.service/job_77\n")
    assert in_job(fake, "77") and not in_slurm_job(fake, "77", mounts)
    os.chown(deleg / "job_77", 1000, 1000)
    os.chown(deleg, 0, 0)
    assert not in_slurm_job(fake, "77", mounts)  # its own folder is the user's
    assert not in_slurm_job(parse_proc_cgroup("0::/elsewhere\n"), "77", mounts)


@needs_cgroups
def test_a_process_that_is_not_the_trees_any_more_goes_straight_back(job_cgroup: Path) -> None:
    """adopt moves by pid numbers read a moment before: one whose number another process
    took since (not among the members read after the moves) is moved back to where it
    was, and forgotten."""
    proc = _start_in(job_cgroup)
    parking = cgroups.Parking.create("t4", proc.pid)
    assert parking is not None
    other = _start_in(job_cgroup)
    try:
        parking.adopt([proc.pid, other.pid], members=lambda: {proc.pid})
        assert proc.pid in parking.pids() and other.pid not in parking.pids()
        assert other.pid not in parking.homes and _where(other.pid).endswith(job_cgroup.name)
        assert parking.return_home() == []
    finally:
        parking.remove()
        for p in (proc, other):
            p.kill()
            p.wait()


@needs_cgroups
def test_the_sweep_removes_a_parked_cgroup_with_a_hold_left_in_it() -> None:
    """A parked tree's freeze hold is made inside its parked cgroup (``hold/tree``): the
    sweep removed only one level below a parked cgroup, so a hold left there kept the
    parked cgroup for good (a review, 2026-12-08)."""
    assert HIERARCHY is not None
    tag = cgroups.root_tag(Path(f"/tmp/root-nested-{os.getpid()}"))
    left = HIERARCHY[1] / f"{cgroups.PREFIX}{tag}-7-{os.getpid()}"
    tree = left / f"{cgroups.PREFIX}{tag}-hold-0123abcd" / "tree"
    tree.mkdir(parents=True)
    try:
        assert cgroups.sweep(tag) == [str(left)]
        assert not left.exists()
    finally:
        for d in (tree, tree.parent, left):
            if d.exists():
                d.rmdir()
