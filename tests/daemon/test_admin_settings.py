"""The admin guide's settings file (docs/slurm.md, `/etc/default/spswap`) walked through
every reader (issue 15 items 9 and 10): slurm/prolog.sh as slurmd runs it (root, a job's
environment), the daemon it starts, the CLI (`spswap status`, `daemon stop` and `start`
by hand) and systemd's own parser of `EnvironmentFile=` with `spswap daemon run` as
slurm/spswapd.service starts it. Each must end with the same settings."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spswap.config import Config
from spswap.daemon import lifecycle
from spswap.daemon.client import Client
from tests.daemon.conftest import ENTRY_CALL, prolog_env
from tests.daemon.test_prolog import run_like_slurmd

REPO = Path(__file__).resolve().parents[2]
SYSTEMD_ENV_PARSER = Path("/usr/lib/systemd/user-environment-generators/"
                          "30-systemd-environment-d-generator")  # fmt: skip


def documented_settings(cfg: Config, spswap_bin: Path) -> str:
    """The guide's file, with this test's root and spswap, and its SPSWAP_GPUS line on."""
    doc = (REPO / "docs" / "slurm.md").read_text()
    text = doc.split("`/etc/default/spswap`", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    text = re.sub(r"^SPSWAP_ROOT=.*$", f"SPSWAP_ROOT={cfg.root}", text, flags=re.M)
    text = re.sub(r"^SPSWAP_BIN=.*$", f"SPSWAP_BIN={spswap_bin}", text, flags=re.M)
    assert "#SPSWAP_GPUS=" in text, "the guide no longer shows SPSWAP_GPUS"
    return text.replace("#SPSWAP_GPUS=0,1,2,3", "SPSWAP_GPUS=0,1")


def spswap_script(tmp_path: Path) -> Path:
    """An `spswap` executable running this checkout's code, as the installed one would."""
    exe = tmp_path / "spswap"
    exe.write_text(f'#!/bin/sh\nexec {sys.executable} -c {shlex.quote(ENTRY_CALL)} "$@"\n')
    exe.chmod(0o755)
    return exe


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().partition("=")[::2] for item in raw if item)


def systemd_env(path: Path, tmp_path: Path) -> dict[str, str]:
    """What systemd's own env-file parser (the one EnvironmentFile= uses) makes of ``path``."""
    conf = tmp_path / "xdg" / "environment.d"
    conf.mkdir(parents=True)
    (conf / "spswap.conf").write_text(path.read_text())
    out = subprocess.run([str(SYSTEMD_ENV_PARSER)], capture_output=True, text=True, check=True,
                         env={"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "PATH": "/usr/bin:/bin"},
                         timeout=30).stdout  # fmt: skip
    pairs = (shlex.split(line)[0].partition("=") for line in out.splitlines() if line)
    return {k: v for k, _, v in pairs if k.startswith("SPSWAP_")}


def cli(exe: Path, defaults: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`spswap ARGS` as root at a shell with no SPSWAP_* set: only the settings file."""
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "SPSWAP_DEFAULTS": str(defaults), "HOME": "/root"}  # fmt: skip
    return subprocess.run([str(exe), *args], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def test_the_guides_settings_file_gives_every_reader_the_same_settings(
    cfg: Config, tmp_path: Path
) -> None:  # fmt: skip
    exe = spswap_script(tmp_path)
    defaults = tmp_path / "default-spswap"
    defaults.write_text(documented_settings(cfg, exe))
    want = Config.load({"SPSWAP_DEFAULTS": str(defaults)})
    assert want.root == cfg.root and want.gpus == (0, 1)
    assert want.pool_capacity_bytes == 256 << 30 and want.keep_bytes == 64 << 30

    # 1. the prolog, as slurmd runs it: the job's environment, the root only in the file
    env = {k: v for k, v in prolog_env(cfg, "7300").items() if k != "SPSWAP_ROOT"}
    env.update(SPSWAP_DEFAULTS=str(defaults), CUDA_VISIBLE_DEVICES="0", SLURM_JOB_UID="0")
    rc, out, _ = run_like_slurmd(["/bin/bash", str(REPO / "slurm" / "prolog.sh")], env)
    assert rc == 0, out
    pid = lifecycle.daemon_running(cfg)
    assert pid and pid > 0, (cfg.paths.log / "prolog.log").read_text()
    # item 9: none of the first job's environment in the daemon's
    theirs = environ_of(pid)
    leaked = sorted(k for k in theirs if k.startswith("SLURM") or k == "CUDA_VISIBLE_DEVICES")
    assert leaked == [], theirs
    status = Client(cfg).call("status")
    assert status["settings"] == want.to_json()
    assert status["gpus"] == [0, 1]  # from the file, not the job's CUDA_VISIBLE_DEVICES=0
    assert [j["job_id"] for j in Client(cfg).call("jobs.list")] == ["7300"]

    # 2. root's CLI at a plain shell: the same settings, no difference reported
    res = cli(exe, defaults, "status", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["root"] == str(cfg.root) and [g["index"] for g in data["gpus"]] == [0, 1]
    assert data["pool"]["capacity_bytes"] == 256 << 30
    assert data["settings"]["file"] == str(defaults) and data["settings"]["differs"] == []

    # 3. `spswap daemon stop && spswap daemon start` by hand keeps the file's settings
    assert cli(exe, defaults, "daemon", "stop").returncode == 0
    res = cli(exe, defaults, "daemon", "start")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"settings: {defaults}, then SPSWAP_* of the environment" in res.stdout, res.stdout
    # item 11: a setting this node cannot hold is said, with the numbers
    from spswap.settings_check import node_sizes

    mem = node_sizes(want).mem_total_bytes
    if mem and mem < 64 << 30:
        assert "warning: SPSWAP_KEEP_BYTES=64.0 GiB is more than this node's" in res.stderr
    again = lifecycle.daemon_running(cfg)
    assert again and again != pid
    assert Client(cfg).call("status")["settings"] == want.to_json()
    lifecycle.stop(cfg)


@pytest.mark.skipif(not SYSTEMD_ENV_PARSER.exists(), reason="systemd's env-file parser absent")
def test_systemd_reads_the_guides_file_as_the_hooks_do(cfg: Config, tmp_path: Path) -> None:
    exe = spswap_script(tmp_path)
    defaults = tmp_path / "default-spswap"
    defaults.write_text(documented_settings(cfg, exe))
    want = Config.load({"SPSWAP_DEFAULTS": str(defaults)})
    unit = (REPO / "slurm" / "spswapd.service").read_text()
    assert "EnvironmentFile=-/etc/default/spswap" in unit
    exec_start = re.search(r"^ExecStart=(.*)$", unit, re.M)
    assert exec_start and exec_start[1].split()[1:] == ["daemon", "run"]
    # systemd's own parser of the file, then `spswap daemon run` with what it gave
    unit_env = {**dict(re.findall(r"^Environment=(\w+)=(.*)$", unit, re.M)),
                **systemd_env(defaults, tmp_path)}  # fmt: skip
    assert Config.from_env(unit_env) == want
    env = {**unit_env, "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
           "SPSWAP_DEFAULTS": str(defaults)}  # fmt: skip
    proc = subprocess.Popen([str(exe), "daemon", "run"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd="/")  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not lifecycle.ping(cfg):
            assert proc.poll() is None and time.monotonic() < deadline, "spswapd did not come up"
            time.sleep(0.05)
        assert Client(cfg).call("status")["settings"] == want.to_json()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert os.path.exists(cfg.paths.run)
