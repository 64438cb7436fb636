"""The node's settings file, read the same by every command and the daemon (issue 15
item 10), and the environment spswapd starts with (item 9)."""

from __future__ import annotations

from pathlib import Path

import pytest

from spswap.config import Config
from spswap.daemon.lifecycle import daemon_env
from spswap.errors import ConfigError
from spswap.settings_file import (
    DEFAULT_SETTINGS_FILE,
    parse_settings_text,
    read_settings_file,
    settings_file_path,
)

TEXT = """# comment
SPSWAP_ROOT=/dev/shm/site
export SPSWAP_KEEP_BYTES=4G
SPSWAP_POOL_CAPACITY_BYTES=256G      # optional: inline, as bash drops it
SPSWAP_GPUS="0,1"
SPSWAP_BIN='/opt/spswap/venv/bin/spswap'   # quoted, then a comment
not a setting
1BAD=x
OTHER=kept
"""


def test_parse_settings_text_as_bash_reads_it() -> None:
    assert parse_settings_text(TEXT) == {
        "SPSWAP_ROOT": "/dev/shm/site", "SPSWAP_KEEP_BYTES": "4G",
        "SPSWAP_POOL_CAPACITY_BYTES": "256G", "SPSWAP_GPUS": "0,1",
        "SPSWAP_BIN": "/opt/spswap/venv/bin/spswap", "OTHER": "kept",
    }  # fmt: skip


def test_settings_file_path() -> None:
    assert settings_file_path({}) == DEFAULT_SETTINGS_FILE == Path("/etc/default/spswap")
    assert settings_file_path({"SPSWAP_DEFAULTS": "/srv/spswap.env"}) == Path("/srv/spswap.env")


def test_load_reads_the_file_and_the_environment_goes_over_it(tmp_path) -> None:
    f = tmp_path / "spswap"
    f.write_text(TEXT)
    env = {"SPSWAP_DEFAULTS": str(f), "SPSWAP_KEEP_BYTES": "1G"}
    cfg = Config.load(env)
    assert cfg.root == Path("/dev/shm/site") and cfg.gpus == (0, 1)
    assert cfg.pool_capacity_bytes == 256 << 30 and cfg.keep_bytes == 1 << 30
    assert Config.load(env, root=Path("/tmp/r")).root == Path("/tmp/r")  # --root over both
    # without the file: the environment alone, as before
    assert Config.load({"SPSWAP_DEFAULTS": str(tmp_path / "absent")}) == Config.from_env({})


def test_a_bad_setting_in_the_file_names_the_file(tmp_path) -> None:
    f = tmp_path / "spswap"
    f.write_text("SPSWAP_KEEP_BYTE=4G\n")
    with pytest.raises(ConfigError, match=rf"unknown setting SPSWAP_KEEP_BYTE;.*\(settings: {f}"):
        Config.load({"SPSWAP_DEFAULTS": str(f)})


def test_an_unreadable_file_says_why(tmp_path) -> None:
    got = read_settings_file(tmp_path)  # a directory: cannot be read as a file
    assert got.exists and got.values == {} and got.problem and str(tmp_path) in got.problem
    assert read_settings_file(tmp_path / "absent").problem is None


def test_daemon_env_keeps_settings_and_drops_the_job() -> None:
    prolog = {
        "SLURM_JOB_ID": "1", "SLURM_JOB_UID": "1001", "CUDA_VISIBLE_DEVICES": "0",
        "SLURM_JOB_GPUS": "0", "PYTHONPATH": "/home/u/evil", "LD_PRELOAD": "/home/u/x.so",
        "TMPDIR": "/tmp/job1", "PATH": "/usr/local/sbin:/usr/bin", "LANG": "C.UTF-8",
        "SPSWAP_BIN": "/opt/spswap/venv/bin/spswap", "SPSWAP_KEEP_BYTES": "4G",
        "SPSWAP_ROOT": "/dev/shm/old",
    }  # fmt: skip
    env = daemon_env(prolog, Config.from_env({}, root=Path("/dev/shm/spswap")), "/opt/src")
    assert env == {
        "SPSWAP_BIN": "/opt/spswap/venv/bin/spswap", "SPSWAP_KEEP_BYTES": "4G",
        "SPSWAP_ROOT": "/dev/shm/spswap", "PATH": "/usr/local/sbin:/usr/bin",
        "LANG": "C.UTF-8", "HOME": env["HOME"], "PYTHONPATH": "/opt/src",
    }  # fmt: skip
    bare = daemon_env({}, Config.from_env({}), None)
    assert bare["PATH"] == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert "PYTHONPATH" not in bare and "LANG" not in bare


# -- settings that cannot hold (item 11) -----------------------------------------------------


def test_unfit_settings_name_the_numbers_and_the_fix() -> None:
    from spswap.settings_check import NodeSizes, unfit_settings

    sizes = NodeSizes(fs_bytes=24 << 30, fs_path="/dev/shm/spswap", mem_total_bytes=23 << 30)
    cfg = Config.from_env({"SPSWAP_POOL_CAPACITY_BYTES": "256G", "SPSWAP_KEEP_BYTES": "64G"})
    assert unfit_settings(cfg, sizes) == [
        "SPSWAP_POOL_CAPACITY_BYTES=256.0 GiB is more than the 24.0 GiB file system that "
        "holds /dev/shm/spswap: imports would fail with 'no space left' before the pool is "
        "full. Set it to at most 19.2 GiB, or leave it out (80% of the file system), or give "
        "the tmpfs more room (mount -o remount,size=...)",
        "SPSWAP_KEEP_BYTES=64.0 GiB is more than this node's 23.0 GiB of memory: kept "
        "instances would take the memory the jobs need. Set it well below (the default is "
        "1/8: 2.9 GiB), or 0 to keep none",
    ]
    fits = Config.from_env({"SPSWAP_POOL_CAPACITY_BYTES": "20G", "SPSWAP_KEEP_BYTES": "4G"})
    assert unfit_settings(fits, sizes) == []
    assert unfit_settings(Config.from_env({}), sizes) == []  # the defaults always fit
    unknown = NodeSizes(fs_bytes=None, fs_path="/x", mem_total_bytes=None)
    assert unfit_settings(cfg, unknown) == []
    images = Config.from_env({"SPSWAP_IMAGES_BYTES": "32G", "SPSWAP_IMAGES_USER_BYTES": "40G"})
    assert unfit_settings(images, sizes) == [
        "SPSWAP_IMAGES_BYTES=32.0 GiB is more than the 24.0 GiB file system that holds "
        "/dev/shm/spswap: dumps would find it full first. Set it to at most 12.0 GiB beside "
        "the pool, or leave it out (half of the file system)",
        "SPSWAP_IMAGES_USER_BYTES=40.0 GiB is more than SPSWAP_IMAGES_BYTES=32.0 GiB: one "
        "user's images are bounded by all images' budget anyway. Set it lower (its default "
        "is half of SPSWAP_IMAGES_BYTES)",
    ]
    share = Config.from_env({"SPSWAP_POOL_CAPACITY_BYTES": "16G", "SPSWAP_POOL_USER_BYTES": "20G"})
    assert unfit_settings(share, sizes) == [
        "SPSWAP_POOL_USER_BYTES=20.0 GiB is more than SPSWAP_POOL_CAPACITY_BYTES=16.0 GiB: one "
        "user's imports are bounded by the pool's capacity anyway. Set it lower (its default "
        "is half of SPSWAP_POOL_CAPACITY_BYTES)",
    ]


def test_crowded_budgets_name_both_and_the_fix() -> None:
    from spswap.settings_check import NodeSizes, crowded_budgets

    sizes = NodeSizes(fs_bytes=16 << 30, fs_path="/dev/shm/spswap", mem_total_bytes=64 << 30)
    pool = Config.from_env({"SPSWAP_POOL_CAPACITY_BYTES": "12G"})
    assert crowded_budgets(pool, 12 << 30, 8 << 30, sizes) == (
        "the pool (12.0 GiB) and the images (8.0 GiB, the default half) may take 20.0 GiB "
        "together, more than the 16.0 GiB file system that holds /dev/shm/spswap: with the "
        "pool full a dump can find no room (it is refused, and the job's next run starts "
        "from the pool). Set SPSWAP_POOL_CAPACITY_BYTES and SPSWAP_IMAGES_BYTES to add up to "
        "at most 16.0 GiB, or give the root a tmpfs of its own of at least 20.0 GiB "
        '(docs/slurm.md, "The root\'s tmpfs in huge pages")'
    )
    assert crowded_budgets(pool, 8 << 30, 8 << 30, sizes) is None  # they fit: no warning
    # the defaults (80% and half) always overlap: said too (the walk: removing a pool
    # setting that warned gave a larger default pool, and "ok")
    defaults = Config.from_env({})
    said = crowded_budgets(defaults, 12 << 30, 8 << 30, sizes)
    assert said is not None and said.startswith(
        "the pool (12.0 GiB, the default 80%) and the images (8.0 GiB, the default half)"
    )
    unknown = NodeSizes(fs_bytes=None, fs_path="/x", mem_total_bytes=None)
    assert crowded_budgets(pool, 12 << 30, 8 << 30, unknown) is None


def test_node_sizes_reads_this_node(tmp_path) -> None:
    from spswap.settings_check import node_sizes

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24117248 kB\nMemFree: 1 kB\n")
    sizes = node_sizes(Config.from_env({}, root=tmp_path / "not" / "yet"), meminfo)
    assert sizes.mem_total_bytes == 24117248 * 1024 and sizes.fs_bytes and sizes.fs_bytes > 0


def test_settings_differences() -> None:
    from spswap.settings_check import settings_differences

    here = Config.from_env({}).to_json()
    daemon = Config.from_env({"SPSWAP_POOL_CAPACITY_BYTES": "256G",
                              "SPSWAP_GPUS": "0,1"}).to_json()  # fmt: skip
    assert settings_differences(here, daemon) == [
        "SPSWAP_GPUS: the default here, 0,1 in spswapd",
        "SPSWAP_POOL_CAPACITY_BYTES: the default here, 256.0 GiB in spswapd",
    ]
    keep0 = Config.from_env({"SPSWAP_KEEP_BYTES": "0"}).to_json()
    assert settings_differences(keep0, here) == [
        "SPSWAP_KEEP_BYTES: 0 here, the default in spswapd"
    ]
    assert settings_differences(here, here) == []
    on_gpu = Config.from_env({"SPSWAP_KEEP_ON_GPU": "1"}).to_json()  # (as the file says it)
    assert settings_differences(here, on_gpu) == ["SPSWAP_KEEP_ON_GPU: 0 here, 1 in spswapd"]
    # a daemon of another spswap version that lacks a setting: not "the default"
    older = {k: v for k, v in here.items() if k != "SPSWAP_KEEP_BYTES"}
    assert settings_differences(here, older) == [
        "SPSWAP_KEEP_BYTES: the default here, not known (another spswap version) in spswapd"
    ]


def test_the_restart_hint_says_when_spswapd_reads_its_file() -> None:
    from spswap.settings_check import restart_hint

    assert restart_hint("/etc/default/spswap") == (
        "spswapd reads /etc/default/spswap when it starts: to apply an edit, restart it as "
        "root (`systemctl restart spswapd` where its systemd unit runs it, else `spswap "
        "daemon stop; spswap daemon start`; instances kept alive are ended then, their "
        "images stay); a SPSWAP_* variable of this shell's environment is this shell's alone"
    )
    # root's shell in a checkout: the spswap that runs, by its path
    assert "else `/opt/x/.venv/bin/spswap daemon stop; /opt/x/.venv/bin/spswap daemon " \
        "start`;" in restart_hint(None, "/opt/x/.venv/bin/spswap")  # fmt: skip


def test_spswap_command_is_the_running_one_where_path_finds_none(tmp_path, monkeypatch) -> None:
    import shutil
    import sys

    from spswap.settings_check import spswap_command

    exe = tmp_path / "venv" / "bin" / "spswap"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    monkeypatch.setattr(sys, "argv", [str(exe)])
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert spswap_command() == str(exe.resolve())
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/local/bin/spswap")
    assert spswap_command() == "spswap"
