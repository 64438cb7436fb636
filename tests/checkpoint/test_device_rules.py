"""The job's device rules (cgroup v2 BPF programs) carried to a parked cgroup.

The argument blocks are checked byte for byte; the rest runs on the real kernel (root, a
cgroup v2 hierarchy and BPF; skipped with the reason elsewhere), with a test program that
denies /dev/null standing in for Slurm's ConstrainDevices program."""

from __future__ import annotations

import os
import secrets
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spswap.checkpoint import cgroups, device_rules
from spswap.checkpoint.cgroup_paths import memberships
from spswap.checkpoint.device_rules import Carried
from tests.helpers.bpf_device import attach_deny_char
from tests.uids import spawn_as

NULL = (1, 3)  # /dev/null


def test_query_block_exactly() -> None:
    block = device_rules.query_attr(7, 0x1122334455, 64)
    assert len(block) == 128
    assert block[:28] == struct.pack("<IIIIQI", 7, 6, 1, 0, 0x1122334455, 64)
    assert set(block[28:]) == {0}
    assert device_rules.query_attr(7, 16, 8, effective=False)[:12] == struct.pack("<III", 7, 6, 0)
    back = bytearray(block)
    back[24:28] = struct.pack("<I", 3)
    assert device_rules.query_count(bytes(back)) == 3


def test_attach_detach_and_fd_blocks_exactly() -> None:
    assert device_rules.attach_attr(5, 9)[:20] == struct.pack("<IIIII", 5, 9, 6, 2, 0)
    assert device_rules.attach_attr(5, 9, detach=True)[:20] == struct.pack("<IIIII", 5, 9, 6, 0, 0)
    assert device_rules.fd_by_id_attr(42) == struct.pack("<III", 42, 0, 0) + bytes(116)


def _v2_base() -> Path:
    if os.geteuid() != 0:
        pytest.skip("needs root: cgroups and BPF programs")
    try:
        base = cgroups.own_dirs(cgroups.mounts()).get("")
    except OSError as e:
        pytest.skip(f"no mountinfo: {e}")
    if base is None:
        pytest.skip("no cgroup v2 hierarchy here")
    return base


@pytest.fixture
def job_cgroup() -> Iterator[Path]:
    """A stand-in job cgroup whose device rules deny /dev/null."""
    d = _v2_base() / f"spswap-test-job-{secrets.token_hex(4)}"
    d.mkdir()
    try:
        try:
            attach_deny_char(d, *NULL)
        except OSError as e:
            pytest.skip(f"cannot load a cgroup-device BPF program here: {e}")
        yield d
    finally:
        cgroups.kill_cgroups([d], timeout_s=10)
        d.rmdir()


def _opens_null_when_parked() -> str:
    """In the child (the second uid): wait until it is parked, then try /dev/null."""
    deadline = time.monotonic() + 20
    while cgroups.PREFIX not in Path("/proc/self/cgroup").read_text():
        if time.monotonic() > deadline:
            return "never parked"
        time.sleep(0.01)
    try:
        os.close(os.open("/dev/null", os.O_RDONLY))
        return "opened"
    except OSError as e:
        return f"denied ({e.strerror})"


def test_carry_gives_a_new_cgroup_the_rules_in_force(job_cgroup: Path) -> None:
    target = job_cgroup.parent / f"spswap-test-copy-{secrets.token_hex(4)}"
    target.mkdir()
    try:
        assert device_rules.carry(job_cgroup, target) == (Carried.COPIED, "")
        assert device_rules.effective_programs(target) == device_rules.effective_programs(
            job_cgroup
        )
        empty = job_cgroup.parent  # no rules in force where the test runs
        assert device_rules.replace(empty, target) == (Carried.NOT_NEEDED, "")
        assert device_rules.effective_programs(target, effective=False) == []
    finally:
        target.rmdir()


def test_a_parked_tree_of_another_uid_still_cannot_open_what_its_job_denied(
    job_cgroup: Path, user_uid: int
) -> None:
    """Security: parked outside its job (where a kept instance is thawed and a dump's CUDA
    checkpoint runs), a user's process met no device rules at all before they were
    carried: it could open any GPU of the node."""
    child = spawn_as(user_uid, _opens_null_when_parked)
    parking = None
    try:
        (job_cgroup / "cgroup.procs").write_text(str(child.pid))
        parking = cgroups.Parking.create(f"test-{secrets.token_hex(4)}", child.pid)
        assert parking is not None and "" in parking.dirs
        parking.adopt([child.pid])
        assert child.result().startswith("denied")
        assert parking.devices is Carried.COPIED, parking.devices_reason
    finally:
        if parking is not None:
            parking.kill_all(timeout_s=10)
            parking.remove()


def test_a_kept_tree_takes_its_new_runs_rules(job_cgroup: Path, user_uid: int) -> None:
    """A kept tree is thawed under the rules of the run that takes it back (which may
    name other GPUs than its old job's), not its old job's."""
    new_run = job_cgroup.parent / f"spswap-test-run-{secrets.token_hex(4)}"
    new_run.mkdir()
    child = spawn_as(user_uid, _opens_null_when_parked)
    parking = None
    try:
        (job_cgroup / "cgroup.procs").write_text(str(child.pid))
        parking = cgroups.Parking.create(f"test-{secrets.token_hex(4)}", child.pid)
        assert parking is not None and parking.devices is Carried.COPIED
        # the new run's process: in a cgroup without rules (its job allows /dev/null)
        (new_run / "cgroup.procs").write_text(str(os.getpid()))
        try:
            assert parking.take_device_rules(memberships(os.getpid())) is Carried.NOT_NEEDED
        finally:
            (job_cgroup.parent / "cgroup.procs").write_text(str(os.getpid()))
        parking.adopt([child.pid])
        assert child.result() == "opened"
    finally:
        if parking is not None:
            parking.kill_all(timeout_s=10)
            parking.remove()
        new_run.rmdir()
