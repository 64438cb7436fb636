"""spswap doctor's test dump of another uid's process and its unprivileged-mode checks:
the judging on exact values, and the real dump on this machine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spswap import doctor_criu
from spswap.checkpoint.criu_log import CAP_SYS_RESOURCE_FIX
from spswap.config import Config
from tests.checkpoint.criu_helpers import needs_criu


def test_the_kernel_row() -> None:
    assert doctor_criu.unprivileged_kernel_check(40) == {
        "name": "criu as the user: kernel", "ok": True, "required": False,
        "value": "CAP_CHECKPOINT_RESTORE known (Linux >= 5.9)", "detail": ""}  # fmt: skip
    old = doctor_criu.unprivileged_kernel_check(38)
    assert (old["ok"], old["required"]) == (False, True)
    assert old["value"] == "no CAP_CHECKPOINT_RESTORE (cap_last_cap 38)"
    assert old["detail"].startswith("this kernel refuses CRIU's --unprivileged mode (it needs "
                                    "Linux >= 5.9)")  # fmt: skip
    assert doctor_criu.unprivileged_kernel_check(None)["ok"] is None


def test_the_gpu_device_files_row() -> None:
    assert doctor_criu.gpu_nodes_check({}) is None
    ok = doctor_criu.gpu_nodes_check({"/dev/nvidia0": 0o666, "/dev/nvidiactl": 0o666})
    assert ok is not None and ok["ok"] is True
    assert ok["value"] == "2 /dev/nvidia* files open to users"
    closed = doctor_criu.gpu_nodes_check({"/dev/nvidia0": 0o660, "/dev/nvidiactl": 0o666})
    assert closed is not None and closed["ok"] is None
    assert closed["value"] == "not open to every user: /dev/nvidia0"


def test_the_test_dump_rows() -> None:
    good = doctor_criu.test_dump_check("as the user", 65534, "nobody", None, 0.081, True)
    assert good["value"] == "dumped and restored a process of nobody (uid 65534) in 0.08 s"
    bad = doctor_criu.test_dump_check(
        "as root", 65534, "nobody", "criu dump: Can't get rlimit 0: Operation not permitted",
        0.1, True)  # fmt: skip
    assert bad == {
        "name": "criu test dump as root", "ok": False, "required": True,
        "value": "criu dump: Can't get rlimit 0: Operation not permitted",
        "detail": "every job's checkpoint fails the same way: " + CAP_SYS_RESOURCE_FIX}  # fmt: skip
    shown = doctor_criu.test_dump_check("as root", 1, "x", "criu dump: Can't get rlimit 0", 0.1,
                                        False)  # fmt: skip
    assert shown["ok"] is None and shown["detail"].startswith("not the site's setting")


def _root_has(cap: int) -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> cap & 1)
    return False


@needs_criu
def test_doctor_test_dumps_another_uids_process_both_ways() -> None:
    """As the user (the default): dumped and restored. As root (the site setting): on
    these machines root lacks CAP_SYS_RESOURCE and doctor says so, with CRIU's error."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    rows = {r["name"]: r for r in doctor_criu.checks(Config.from_env({"SPSWAP_CRIU_AS_ROOT": "1"}),
                                                     True)}  # fmt: skip
    user = rows["criu test dump as the user"]
    assert user["ok"] is True and user["required"] is False, user
    assert user["value"].startswith("dumped and restored a process of ")
    root = rows["criu test dump as root"]
    if _root_has(24):  # CAP_SYS_RESOURCE
        assert root["ok"] is True, root
    else:
        assert root == {
            **root,
            "ok": False,
            "required": True,
            "value": "criu dump: Can't get rlimit 0: Operation not permitted",
        }
        assert CAP_SYS_RESOURCE_FIX in root["detail"]
    assert not list(Path("/tmp").glob("spswap-doctor-*")), "doctor leaves nothing behind"
