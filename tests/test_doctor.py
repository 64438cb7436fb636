"""spswap doctor: parsers on captured text, collect() on this machine, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from spswap import doctor, doctor_node
from spswap.cli.app import app
from spswap.config import Config

NVIDIA_VERSION = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  "
    "(dvs-builder@U22-I3-AE18-09-3)  Thu Jan  1 00:00:00 UTC 2026\n"
    "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
)
NVIDIA_VERSION_PROPRIETARY = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Thu Jan 16 2025\n"
)
MOUNTS = """\
/dev/vda / ext4 rw 0 0
tmpfs /dev/shm tmpfs rw,size=24684084k 0 0
tmpfs /dev/shm/spswap/images tmpfs rw,size=1024k 0 0
tmpfs /tmp/a\\040b tmpfs rw 0 0
"""


@pytest.mark.parametrize(
    ("release", "expected"),
    [("6.18.44-fc-v669", (6, 18)), ("5.14.0-427.el9.x86_64", (5, 14)), ("weird", (0, 0))],
)
def test_kernel_version(release: str, expected: tuple[int, int]) -> None:
    assert doctor.kernel_version(release) == expected


def test_kernel_config_value() -> None:
    text = 'CONFIG_A=y\n# CONFIG_CHECKPOINT_RESTORE is not set\nCONFIG_B="x y"\nCONFIG_M=m\n'
    assert doctor.kernel_config_value(text, "CONFIG_CHECKPOINT_RESTORE") == "n"
    assert doctor.kernel_config_value(text, "CONFIG_A") == "y"
    assert doctor.kernel_config_value(text, "CONFIG_B") == "x y"
    assert doctor.kernel_config_value(text, "CONFIG_M") == "m"
    assert doctor.kernel_config_value(text, "CONFIG_NONE") is None


def test_parse_nvidia_version() -> None:
    assert doctor.parse_nvidia_version(NVIDIA_VERSION) == "580.159.04"
    assert doctor.parse_nvidia_version(NVIDIA_VERSION_PROPRIETARY) == "570.86.15"
    assert doctor.parse_nvidia_version("garbage") is None
    assert doctor.driver_major("580.159.04") == 580


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/dev/shm/spswap", ("/dev/shm", "tmpfs")),
        ("/dev/shm/spswap/images/k", ("/dev/shm/spswap/images", "tmpfs")),
        ("/dev/shmother", ("/", "ext4")),
        ("/tmp/a b/x", ("/tmp/a b", "tmpfs")),
        ("/var/lib", ("/", "ext4")),
    ],
)
def test_mount_for(path: str, expected: tuple[str, str]) -> None:
    found = doctor_node.mount_entry(Path(path), MOUNTS)
    assert found is not None and found[:2] == expected


def test_mount_entry_gives_the_mounts_options() -> None:
    mounts = (
        MOUNTS + "spswap-root /dev/shm/spswap tmpfs rw,relatime,size=100g,huge=within_size 0 0\n"
    )
    assert doctor_node.mount_entry(Path("/dev/shm/spswap/pool/x"), mounts) == (
        "/dev/shm/spswap", "tmpfs", "rw,relatime,size=100g,huge=within_size")  # fmt: skip
    assert doctor_node.mount_entry(Path("/var"), "/dev/vda / ext4\n") == ("/", "ext4", "")


ROOT_FIX = doctor_node.ROOT_HUGE_FIX


@pytest.mark.parametrize(("mount", "shmem", "row"), [
    (("/dev/shm/spswap", "tmpfs", "rw,size=100g,huge=within_size"), "never",
     (True, "tmpfs at /dev/shm/spswap, huge=within_size: 2 MiB pages", "")),
    (("/run/spswap", "tmpfs", "rw,huge=always"), None,
     (True, "tmpfs at /run/spswap, huge=always: 2 MiB pages", "")),
    (("/dev/shm", "tmpfs", "rw,nosuid,nodev"), "never",
     (None, "tmpfs at /dev/shm, huge=never: 4 KiB pages", ROOT_FIX)),
    (("/dev/shm", "tmpfs", "rw,huge=advise"), "never",
     (None, "tmpfs at /dev/shm, huge=advise: 4 KiB pages", ROOT_FIX)),
    (("/dev/shm", "tmpfs", "rw"), "force",
     (True, "tmpfs at /dev/shm, huge=never; shmem_enabled force: 2 MiB pages", "")),
    (("/dev/shm/spswap", "tmpfs", "rw,huge=within_size"), "deny",
     (None, "tmpfs at /dev/shm/spswap, huge=within_size, but shmem_enabled is deny: 4 KiB "
      "pages", "set /sys/kernel/mm/transparent_hugepage/shmem_enabled to never (it then "
      "follows the mount)")),
    (("/", "ext4", "rw"), "never",
     (None, "/dev/shm/spswap is not on a tmpfs (see the storage row)", ROOT_FIX)),
    (None, None, (None, "/dev/shm/spswap is not on a tmpfs (see the storage row)", ROOT_FIX)),
])  # fmt: skip
def test_the_root_huge_pages_row(
    mount: tuple[str, str, str] | None, shmem: str | None, row: tuple[bool | None, str, str]
) -> None:
    got = doctor_node.root_huge_check("/dev/shm/spswap", mount, shmem)
    assert (got["name"], got["ok"], got["value"], got["detail"]) == ("root huge pages", *row)
    assert got["required"] is False
    assert "huge=within_size" in ROOT_FIX and "docs/slurm.md" in ROOT_FIX
    # a node without a GPU: information only, the same pages said
    cpu = doctor_node.root_huge_check("/dev/shm/spswap", mount, shmem, gpu_node=False)
    assert cpu["ok"] is True and cpu["detail"] == ""
    assert cpu["value"].startswith(row[1]), cpu
    if row[0] is None:
        assert cpu["value"].endswith(" (no GPU here: they matter for GPU copies only)")


def test_mount_points_with_escaped_characters() -> None:
    mounts = "/dev/vda / ext4 rw 0 0\nt /mnt/a\\011b\\134c tmpfs rw,huge=always 0 0\n"
    assert doctor_node.mount_entry(Path("/mnt/a\tb\\c/x"), mounts) == (
        "/mnt/a\tb\\c", "tmpfs", "rw,huge=always")  # fmt: skip


def test_of_two_mounts_on_one_point_the_later_one_counts() -> None:
    mounts = (MOUNTS + "a /dev/shm/spswap tmpfs rw,huge=never 0 0\n"
              "b /dev/shm/spswap tmpfs rw,huge=within_size 0 0\n")  # fmt: skip
    assert doctor_node.mount_entry(Path("/dev/shm/spswap"), mounts) == (
        "/dev/shm/spswap", "tmpfs", "rw,huge=within_size")  # fmt: skip


def test_cgroup_mode(tmp_path: Path) -> None:
    assert doctor.cgroup_mode(tmp_path) == "v1"
    (tmp_path / "unified").mkdir()
    (tmp_path / "unified" / "cgroup.controllers").write_text("")
    assert doctor.cgroup_mode(tmp_path) == "hybrid"
    (tmp_path / "cgroup.controllers").write_text("cpu memory")
    assert doctor.cgroup_mode(tmp_path) == "v2"


EXPECTED = {
    "criu", "kernel", "CONFIG_CHECKPOINT_RESTORE", "kernel.io_uring_disabled", "NVIDIA driver",
    "GPUs", "cuCheckpoint API", "cgroup mode", "daemon",
}  # fmt: skip


def test_collect_on_this_machine(tmp_path: Path) -> None:
    report = doctor.collect(Config(root=tmp_path / "root"))
    names = {c["name"] for c in report["checks"]}
    assert EXPECTED <= names
    assert any(n.startswith("storage (") for n in names)
    for c in report["checks"]:
        assert c["name"] and isinstance(c["value"], str) and isinstance(c["detail"], str)
        assert c["ok"] in (True, False, None)
        if c["ok"] is False:
            assert c["detail"], f"{c['name']} fails without saying what to do"
        if c["ok"] is True:  # details are what to do: only a warn or fail row has them
            assert not c["detail"], f"{c['name']} is ok but says {c['detail']!r}"
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["daemon"]["ok"] is None  # nothing runs under this fresh root
    release = os.uname().release
    assert by_name["kernel"]["value"] == release
    json.dumps(report)  # plain data


@pytest.mark.parametrize("release", ["5.15.0-91-generic", "6.16.3"])
def test_the_kernel_row_is_clean_when_ok(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                         release: str) -> None:  # fmt: skip
    # an ok kernel row said "CRIU >= 4.1 needed (>= 6.13)" (newcomer walk): the criu row
    # says that when CRIU is too old for the kernel
    monkeypatch.setattr(doctor, "_criu_checks", lambda release, path, setting: [])
    monkeypatch.setattr(doctor.doctor_criu, "checks", lambda cfg, usable: [])
    monkeypatch.setattr(doctor.platform, "release", lambda: release)
    rows = {c["name"]: c for c in doctor.collect(Config(root=tmp_path / "root"))["checks"]}
    assert rows["kernel"] == doctor.check("kernel", True, release)


def test_daemon_seen_through_its_locked_pid_file(tmp_path: Path) -> None:
    cfg = Config(root=tmp_path)
    cfg.paths.run.mkdir(parents=True)
    pid_file = cfg.paths.run / "spswapd.pid"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(pid_file)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.write(fd, str(os.getpid()).encode())\n"
        "print('locked', flush=True)\n"
        "time.sleep(30)\n"
    )], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        checks = {c["name"]: c for c in doctor.collect(cfg)["checks"]}
        assert checks["daemon"]["ok"] is True
        assert checks["daemon"]["value"] == f"pid {holder.pid}"
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.05)
    checks = {c["name"]: c for c in doctor.collect(cfg)["checks"]}
    assert checks["daemon"]["ok"] is None  # stale pid file: nobody holds the lock


def test_cli_json_and_table(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["doctor", "--json", "--root", str(tmp_path)])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["version"] == 1 and EXPECTED <= {c["name"] for c in report["checks"]}
    res = runner.invoke(app, ["doctor", "--root", str(tmp_path)])
    assert res.exit_code == 0 and "criu" in res.stdout and "daemon" in res.stdout


def test_strict_fails_on_an_old_criu(tmp_path: Path) -> None:
    old = tmp_path / "criu"
    old.write_text("#!/bin/sh\necho 'Version: 3.17.1'\n")
    old.chmod(0o755)
    runner = CliRunner()
    env = {"SPSWAP_CRIU": str(old)}
    res = runner.invoke(app, ["doctor", "--json", "--root", str(tmp_path)], env=env)
    assert res.exit_code == 0  # without --strict, a report is not a failure
    criu = next(c for c in json.loads(res.stdout)["checks"] if c["name"] == "criu")
    assert criu["ok"] is False and "3.17.1" in criu["value"] and "build_criu.sh" in criu["detail"]
    res = runner.invoke(app, ["doctor", "--strict", "--root", str(tmp_path)], env=env)
    assert res.exit_code == 1


def test_strict_fails_on_settings_this_node_cannot_hold(tmp_path: Path) -> None:
    """The walk: the guide's example sizes on a small node (a pool larger than its file
    system) were a FAIL that `--strict` let pass (it counted only required checks)."""
    runner = CliRunner()
    env = {"SPSWAP_POOL_CAPACITY_BYTES": "1000T"}
    res = runner.invoke(app, ["doctor", "--json", "--root", str(tmp_path)], env=env)
    settings = next(c for c in json.loads(res.stdout)["checks"] if c["name"] == "settings")
    assert settings["ok"] is False and "SPSWAP_POOL_CAPACITY_BYTES" in settings["detail"]
    res = runner.invoke(app, ["doctor", "--strict", "--root", str(tmp_path)], env=env)
    assert res.exit_code == 1 and "checks failed: " in res.stderr and "settings" in res.stderr


def test_the_criu_named_in_the_settings_file_is_the_one_run(tmp_path: Path) -> None:
    """SPSWAP_CRIU in /etc/default/spswap reaches `spswap doctor` (and every command), not
    only a daemon whose hook exported it; the environment's, when set, comes first."""
    from spswap.checkpoint.criu_find import find_criu

    old = tmp_path / "criu"
    old.write_text("#!/bin/sh\necho 'Version: 3.17.1'\n")
    old.chmod(0o755)
    settings = tmp_path / "spswap.defaults"
    settings.write_text(f"SPSWAP_CRIU={old}\n")
    env = {"SPSWAP_DEFAULTS": str(settings)}
    res = CliRunner().invoke(app, ["doctor", "--json", "--root", str(tmp_path)], env=env)
    criu = next(c for c in json.loads(res.stdout)["checks"] if c["name"] == "criu")
    assert criu["ok"] is False and criu["value"] == f"3.17.1 ({old}, SPSWAP_CRIU)", criu
    # a setting that names no program says so, not "run build_criu.sh"
    settings.write_text(f"SPSWAP_CRIU={tmp_path / 'nowhere'}\n")
    res = CliRunner().invoke(app, ["doctor", "--json", "--root", str(tmp_path)], env=env)
    criu = next(c for c in json.loads(res.stdout)["checks"] if c["name"] == "criu")
    assert criu["value"] == f"SPSWAP_CRIU={tmp_path / 'nowhere'}: not found", criu
    assert "set SPSWAP_CRIU to the criu binary" in criu["detail"], criu
    settings.write_text(f"SPSWAP_CRIU={old}\n")
    other = tmp_path / "other-criu"
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPSWAP_DEFAULTS", str(settings))
        assert find_criu() == old
        mp.setenv("SPSWAP_CRIU", str(other))
        assert find_criu() == other
        # a setting already read (doctor, the demo) is taken as it is
        assert find_criu(setting=str(old)) == old
        assert find_criu(setting=str(tmp_path / "nowhere")) is None


def test_state_tree_writable_by_others_is_a_required_failure(tmp_path):
    import os

    from spswap.config import Config
    from spswap.doctor import collect, failed_checks

    root = tmp_path / "root"
    root.mkdir()
    os.chmod(root, 0o777)
    report = collect(Config.from_env({}, root=root))
    (tree,) = [c for c in report["checks"] if c["name"] == "state tree"]
    # as root: the mode; as another user: the owner (not root) comes first
    assert tree["ok"] is False
    assert "writable by group or others" in tree["value"] or "owned by uid" in tree["value"]
    assert tree in failed_checks(report)


@pytest.mark.parametrize(("release", "version", "patched", "ok"), [
    ("6.18.44-fc", (4, 1, 1), False, False),  # the trap: every TCP socket fails to dump
    ("6.18.44-fc", (4, 1, 1), True, True),
    ("6.12.0", (4, 1, 1), False, True),  # older kernels answer SO_PASSCRED on TCP
    ("6.18.44-fc", (4, 2, 0), False, True),
])  # fmt: skip
def test_criu_tcp_check(release: str, version: tuple[int, int, int], patched: bool,
                        ok: bool) -> None:  # fmt: skip
    row = doctor.criu_tcp_check(release, version, patched)
    assert row["ok"] is ok and row["name"] == "criu on TCP sockets"
    if not ok:
        assert "scripts/build_criu.sh --force" in row["detail"]


def test_patched_criu_reads_the_stamp_of_an_install_or_a_bundle(tmp_path: Path) -> None:
    for criu_bin, stamp_dir in [(tmp_path / "i/sbin/criu", tmp_path / "i"),
                                (tmp_path / "b/criu", tmp_path / "b")]:  # fmt: skip
        criu_bin.parent.mkdir(parents=True)
        criu_bin.write_text("#!/bin/sh\n")
        assert not doctor.patched_criu(criu_bin)
        (stamp_dir / "share/spswap").mkdir(parents=True)
        (stamp_dir / "share/spswap/criu-patches").write_text("sockopts-linux-6.16.patch \n")
        assert doctor.patched_criu(criu_bin)


def test_parking_check_says_what_it_found(tmp_path: Path) -> None:
    """The probe's answer against what this machine allows: make a cgroup beside ours."""
    from spswap.checkpoint import cgroups

    by_name = {c["name"]: c for c in doctor.collect(Config(root=tmp_path / "r"))["checks"]}
    got = by_name["dump outside the job"]
    bases = cgroups.own_dirs(cgroups.mounts()).values()
    allowed = os.geteuid() == 0 and any(os.access(b, os.W_OK) for b in bases)
    assert got["ok"] is (True if allowed else None), got
    if not allowed:
        assert "proctrack/cgroup" in got["detail"]


def test_keep_check() -> None:
    assert doctor_node.keep_check(8 << 30, True) == {
        "name": "keep dumped instances",
        "ok": True,
        "required": False,
        "value": "up to 8.0 GiB (SPSWAP_KEEP_BYTES), frozen in parked cgroups",
        "detail": "",
    }
    off = doctor_node.keep_check(0, True)
    assert off["ok"] is None and off["value"] == "off (SPSWAP_KEEP_BYTES=0)"
    assert "CRIU's restore" in off["detail"]
    assert "dump outside the job" in doctor_node.keep_check(8 << 30, False)["value"]
    unknown = doctor_node.keep_check(8 << 30, None)  # a user's doctor: not checked
    assert unknown["ok"] is None and unknown["value"] == (
        "up to 8.0 GiB (SPSWAP_KEEP_BYTES) where parked cgroups can be made: not checked "
        "(needs root)")  # fmt: skip
    over = doctor_node.keep_check(64 << 30, True, mem_total_bytes=24 << 30)
    assert over["ok"] is None and over["value"] == (
        "up to 64.0 GiB (SPSWAP_KEEP_BYTES): more than this node's 24.0 GiB of memory"
    )
    assert over["detail"] == "see the settings row"
    assert doctor_node.keep_check(8 << 30, True, on_gpu=True)["value"] == (
        "up to 8.0 GiB (SPSWAP_KEEP_BYTES), frozen in parked cgroups, their sleeping GPU "
        "state left on their GPU where CUDA checkpoint works (SPSWAP_KEEP_ON_GPU=1: held "
        "outside any slot until another job reserves there)")  # fmt: skip
    as_user = doctor_node.keep_check(8 << 30, None, on_gpu=True)["value"]  # (said to users too)
    assert "left on their GPU" in as_user and as_user.endswith("not checked (needs root)")
    unused = doctor_node.keep_check(0, True, on_gpu=True)
    assert unused["value"] == "off (SPSWAP_KEEP_BYTES=0); SPSWAP_KEEP_ON_GPU=1 has nothing to keep"
    assert unused["detail"].startswith("set SPSWAP_KEEP_BYTES above 0, or drop SPSWAP_KEEP_ON_GPU")


def test_the_daemon_row_says_when_spswapd_runs_other_settings(monkeypatch) -> None:
    """An edit of the settings file the running spswapd has not read yet: doctor's daemon
    row says so and how to restart it (it said ok while the settings row judged the
    file's values, not the daemon's)."""
    from spswap.config import Config
    from spswap.daemon import lifecycle
    from tests.uids import node_root

    if os.geteuid() != 0:
        pytest.skip("spswapd's tree is root's")
    for name in [k for k in os.environ if k.startswith("SPSWAP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SPSWAP_GPUS", "0")  # the daemon's settings: this shell's,
    monkeypatch.setenv("SPSWAP_DEFAULTS", "/nonexistent")  # not a test cluster's file
    with node_root("spsdoc-", {"SPSWAP_GPUS": "0"}) as cfg:
        lifecycle.start(cfg, wait_s=15.0)
        assert doctor_node.daemon(cfg)["ok"] is True
        edited = Config.from_env({"SPSWAP_GPUS": "0", "SPSWAP_KEEP_BYTES": "0"}, root=cfg.root)
        row = doctor_node.daemon(edited)
        assert row["ok"] is None
        assert row["value"].endswith(
            "with other settings than this shell reads: SPSWAP_KEEP_BYTES: 0 here, the "
            "default in spswapd")  # fmt: skip
        assert row["detail"].startswith("spswapd reads ")


def test_torch_check_names_what_is_missing_and_the_install() -> None:
    row = doctor.torch_check({"torch": "2.13.0", "safetensors": "0.6", "numpy": "2.3"}, "`x`")
    assert (row["ok"], row["value"], row["detail"]) == (True, "2.13.0", "")
    row = doctor.torch_check({"torch": None, "safetensors": "0.6", "numpy": None}, "`x`")
    assert row["ok"] is None and row["value"] == "torch, numpy not installed"
    assert row["detail"] == (
        "spswap serve's default engine (reference), spswap demo, models make and check, "
        "bench transfer and traffic need them: `x` (an admin host that serves no model can "
        "do without)"
    )


def test_the_torch_row_of_this_install_says_torch_s_version() -> None:
    torch = pytest.importorskip("torch")
    row = doctor._torch()
    assert row["ok"] is True and row["value"] == torch.__version__, row


def test_vllm_check() -> None:
    assert doctor.vllm_check("0.26.0", [])["ok"] is True
    row = doctor.vllm_check("0.26.0", ["uvicorn"])
    assert row["ok"] is False and "uvicorn missing" in row["detail"]


def test_gpus_row_names_the_configured_gpus_where_nvml_sees_none(tmp_path: Path) -> None:
    # doctor said "none" while status (and spswapd) used SPSWAP_GPUS=0,1 (newcomer walk)
    if doctor._nvml_checks(None)[0]["ok"]:
        pytest.skip("NVML sees GPUs here: the configured list is not what the row shows")
    row = doctor._nvml_checks((0, 1))[0]
    assert row["name"] == "GPUs" and row["value"] == "0,1 (SPSWAP_GPUS)" and row["ok"], row
    assert row["detail"] == "", row  # ok: nothing to do


def _root_only_checks(root: str) -> dict[str, Any]:
    checks = doctor.collect(Config(root=Path(root)))["checks"]
    return {
        c["name"]: c
        for c in checks
        if c["name"]
        in ("dump outside the job", "freeze for the credential check", "keep dumped instances")
    }


def test_a_users_doctor_does_not_say_no_for_what_spswapd_does_as_root(user_uid: int) -> None:
    """As a user, `spswap doctor` said "dump outside the job: freezer: Permission denied"
    and "keep dumped instances: no" on a node where spswapd (root) keeps every dump."""
    from tests.uids import as_user

    got = as_user(user_uid, _root_only_checks, "/tmp/spswap-doctor-user-test")
    assert got["dump outside the job"]["value"] == (
        f"not checked as uid {user_uid}: spswapd does it as root"
    )
    assert got["freeze for the credential check"]["ok"] is None
    keep = got["keep dumped instances"]
    assert keep["ok"] is None and "not checked (needs root)" in keep["value"], keep
    assert keep["detail"] == "run `sudo spswap doctor` for the node's answer"


def test_thp_mode_is_the_bracketed_word() -> None:
    assert doctor_node.thp_mode("always [madvise] never\n") == "madvise"
    assert doctor_node.thp_mode("[always] madvise never") == "always"
    assert doctor_node.thp_mode(None) is None and doctor_node.thp_mode("") is None


FIX_CRIU = (
    "rebuild it with scripts/build_criu.sh (as root), which applies it; until then "
    "the setting does nothing"
)
THP_PATCH = frozenset({"thp-fill.patch"})


@pytest.mark.parametrize(("on", "criu", "patches", "thp", "row"), [
    (False, "/c", None, "madvise", (True, "off: CRIU's own fill (THP madvise): "
     "SPSWAP_RESTORE_HUGEPAGES=1 may restore faster (measure first: docs/benchmarks.md)", "")),
    (False, "/c", None, "always", (True, "off: CRIU's own fill (THP always): the kernel may "
     "fill in huge pages already", "")),
    (False, None, None, None, (True, "off: CRIU's own fill (no THP in this kernel)", "")),
    (True, "/c", THP_PATCH, "madvise", (True, "on (THP madvise; /c has spswap's thp-fill "
     "patch)", "")),
    (True, "/c", frozenset({"sockopts-linux-6.16.patch"}), "madvise", (False,
     "SPSWAP_RESTORE_HUGEPAGES=1, but /c has no spswap thp-fill patch", FIX_CRIU)),
    (True, "/c", None, "always", (False, "SPSWAP_RESTORE_HUGEPAGES=1, but /c has no spswap "
     "thp-fill patch", FIX_CRIU)),
    (True, None, None, "madvise", (False, "SPSWAP_RESTORE_HUGEPAGES=1, but no CRIU found",
     "see the criu row")),
    (True, "/c", THP_PATCH, "never", (False, "SPSWAP_RESTORE_HUGEPAGES=1, but THP never",
     "the setting does nothing: set /sys/kernel/mm/transparent_hugepage/enabled to "
     "madvise, or remove the setting")),
])  # fmt: skip
def test_the_huge_page_restore_row(
    on: bool, criu: str | None, patches: frozenset[str] | None, thp: str | None,
    row: tuple[bool, str, str],
) -> None:  # fmt: skip
    got = doctor_node.hugepages_check(on, criu, patches, thp)
    assert (got["name"], got["ok"], got["value"], got["detail"]) == ("restore huge pages", *row)
    assert got["required"] is False


def test_the_criu_patches_are_read_from_the_build_stamp(tmp_path: Path) -> None:
    (tmp_path / "sbin").mkdir()
    (tmp_path / "sbin" / "criu").write_text("")
    assert doctor.criu_patches(tmp_path / "sbin" / "criu") is None
    (tmp_path / "share" / "spswap").mkdir(parents=True)
    stamp = tmp_path / "share" / "spswap" / "criu-patches"
    stamp.write_text("sockopts-linux-6.16.patch thp-fill.patch \n")  # (before 2026-12-05)
    assert doctor.criu_patches(tmp_path / "sbin" / "criu") == {
        "sockopts-linux-6.16.patch", "thp-fill.patch"}  # fmt: skip
    stamp.write_text("sockopts-linux-6.16.patch:8b0a6481e110 thp-fill.patch:a431cd72024f ")
    assert doctor.criu_patches(tmp_path / "sbin" / "criu") == {
        "sockopts-linux-6.16.patch", "thp-fill.patch"}  # fmt: skip
    assert doctor.patched_criu(tmp_path / "sbin" / "criu")
    stamp.write_text("thp-fill.patch:a431cd72024f")
    assert not doctor.patched_criu(tmp_path / "sbin" / "criu")  # the TCP patch is not there


def test_the_report_is_a_line_a_check_where_its_table_would_fold_words() -> None:
    """A walk at 80 columns: the table's four columns folded paths ("/usr/local/sbin/criu"
    then ")") and setting names mid-word; where the table fits, it is the table."""
    import io

    from rich.console import Console

    from spswap.cli.doctor import render

    report = {"node": "n1", "checks": [
        {"name": "criu", "ok": True, "value": "4.1.1 (/usr/local/sbin/criu)", "detail": ""},
        {"name": "kernel.io_uring_disabled", "ok": None, "value": "0",
         "detail": "`sysctl -w kernel.io_uring_disabled=2` before engines start"},
        {"name": "x[bold]", "ok": False, "value": "[red]v", "detail": ""},
    ]}  # fmt: skip
    console = Console(width=80, file=io.StringIO(), record=True)
    console.print(render(report))
    assert [ln.rstrip() for ln in console.export_text().splitlines()] == [
        "spswap doctor: n1",
        "ok   criu: 4.1.1 (/usr/local/sbin/criu)",
        "warn kernel.io_uring_disabled: 0",
        "     what to do: `sysctl -w kernel.io_uring_disabled=2` before engines start",
        "FAIL x[bold]: [red]v",  # names and values are text, never markup
    ]
    console = Console(width=50, file=io.StringIO(), record=True)
    console.print(render(report))  # a long line goes on under its own start
    assert [ln.rstrip() for ln in console.export_text().splitlines()][3:5] == [
        "     what to do: `sysctl -w",
        "     kernel.io_uring_disabled=2` before engines",
    ]
    console = Console(width=140, file=io.StringIO(), record=True)
    console.print(render(report))
    text = console.export_text()
    assert "┃ check" in text and "│ kernel.io_uring_disabled │ warn │" in text, text


def test_the_budgets_row_is_not_ok_beside_a_settings_fail(tmp_path: Path) -> None:
    """The re-walk: with a 1000T pool the settings row said FAIL and the budgets row
    "ok ... pool 1000.0 TiB"."""
    from spswap.config import Config
    from spswap.doctor_node import budgets
    from spswap.settings_check import node_sizes, settings_problems

    big = Config.from_env({"SPSWAP_POOL_CAPACITY_BYTES": "1000T"}, root=tmp_path)
    row = budgets(big, settings_problems(big), node_sizes(big))
    assert row["ok"] is None and "see the settings row" in row["detail"], row
    fits = Config.from_env({"SPSWAP_POOL_CAPACITY_BYTES": "1M", "SPSWAP_IMAGES_BYTES": "1M"},
                           root=tmp_path)  # fmt: skip
    assert budgets(fits, settings_problems(fits), node_sizes(fits))["ok"] is True


def test_the_budgets_row_warns_where_set_budgets_overfill_the_root(tmp_path: Path) -> None:
    """The admin walk: a 16G tmpfs with SPSWAP_POOL_CAPACITY_BYTES=12G (the images' default
    half: 8G) said "ok"; the guide sizes the tmpfs at pool + images. The defaults too."""
    from spswap.config import Config
    from spswap.doctor_node import budgets
    from spswap.settings_check import node_sizes, settings_problems

    fs_bytes = node_sizes(Config.from_env({}, root=tmp_path)).fs_bytes
    assert fs_bytes
    pool = Config.from_env({"SPSWAP_POOL_CAPACITY_BYTES": str(fs_bytes * 3 // 4)}, root=tmp_path)
    row = budgets(pool, settings_problems(pool), node_sizes(pool))
    assert row["ok"] is None and "more than the" in row["detail"], row
    both = Config.from_env({"SPSWAP_POOL_CAPACITY_BYTES": str(fs_bytes // 2),
                            "SPSWAP_IMAGES_BYTES": str(fs_bytes // 4)}, root=tmp_path)  # fmt: skip
    assert budgets(both, settings_problems(both), node_sizes(both))["ok"] is True
    defaults = Config.from_env({}, root=tmp_path)  # 80% + half: always more than it
    assert budgets(defaults, settings_problems(defaults), node_sizes(defaults))["ok"] is None


def test_the_cuda_checkpoint_row_on_a_cpu_only_node_says_nothing_is_needed() -> None:
    """A walk: the driver's row said "nothing on a CPU-only node", the row below it asked
    for cuda-bindings."""
    row = doctor.cuda_checkpoint_row("cuda-bindings is not installed (X)", driver=False)
    said = "nothing on a CPU-only node; on a GPU node: cuda-bindings is not installed (X)"
    assert (row["ok"], row["value"], row["detail"]) == (None, "unavailable", said)
    row = doctor.cuda_checkpoint_row("cuda-bindings is not installed (X)", driver=True)
    assert row["detail"] == "cuda-bindings is not installed (X)"
    assert doctor.cuda_checkpoint_row(None, driver=False)["ok"] is True
