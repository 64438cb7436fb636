"""`spswap daemon ...`, `spswap events` and `spswap node --help`, through the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from spswap.config import Config
from spswap.daemon import lifecycle
from tests.daemon.conftest import which_spswap


def spswap(cfg: Config, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPSWAP_ROOT": str(cfg.root), "COLUMNS": "200"}
    return subprocess.run([which_spswap(), *args], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def test_daemon_commands(cfg: Config) -> None:
    r = spswap(cfg, "daemon", "status", "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["running"] is False
    assert json.loads(r.stdout)["problem"] == (
        "spswapd is not running: the Slurm prolog starts it at a job's start on this node "
        "(root: spswap daemon start)"
    )
    r = spswap(cfg, "daemon", "start")
    assert r.returncode == 0 and "spswapd started (pid" in r.stdout, r.stderr
    pid = lifecycle.daemon_running(cfg)
    r = spswap(cfg, "daemon", "start")
    assert f"spswapd already running (pid {pid}" in r.stdout
    assert spswap(cfg, "daemon", "ensure").returncode == 0
    assert lifecycle.daemon_running(cfg) == pid
    st = json.loads(spswap(cfg, "daemon", "status", "--json").stdout)
    assert st["running"] is True and st["pid"] == pid and st["problem"] is None
    r = spswap(cfg, "daemon", "status")
    assert r.returncode == 0 and f"spswapd running: pid {pid}" in r.stdout
    settings = st["settings_file"]
    absent = "" if os.path.exists(settings) else " (absent: the defaults)"
    said = f"settings: {settings}{absent}, then SPSWAP_* of its environment"
    assert said in r.stdout, r.stdout
    events = json.loads(spswap(cfg, "events", "--json", "-n", "5").stdout)
    assert [e["kind"] for e in events] == ["daemon.start"]
    assert "daemon.start" in spswap(cfg, "events").stdout
    r = spswap(cfg, "daemon", "stop")
    assert r.returncode == 0 and f"spswapd stopped (was pid {pid})" in r.stdout
    assert spswap(cfg, "daemon", "stop").stdout.strip() == "spswapd was not running"


def test_a_settings_file_with_an_error_does_not_keep_spswapd_running(
    cfg: Config, tmp_path: Path
) -> None:
    """The walk: an admin edits /etc/default/spswap with a typo, then runs `spswap daemon
    stop; spswap daemon start` as the docs say: the stop refused (exit 2) and the old
    daemon ran on with the old settings. Now it stops, says what to fix, and the start
    refuses until it is fixed."""
    bad = tmp_path / "defaults"
    bad.write_text(f"SPSWAP_ROOT={cfg.root}\nSPSWAP_KEEP_ON_GPU=maybe\n")
    pid = lifecycle.start(cfg, wait_s=15.0)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPSWAP_")}
    env.update({"SPSWAP_DEFAULTS": str(bad), "COLUMNS": "200"})

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([which_spswap(), *args], env=env, capture_output=True, text=True,
                              timeout=60)  # fmt: skip

    r = run("daemon", "stop")
    assert r.returncode == 0 and f"spswapd stopped (was pid {pid})" in r.stdout, r.stderr
    assert (f"warning: SPSWAP_KEEP_ON_GPU='maybe': use 1 (kept instances stay on their GPU) "
            f"or 0 (set in the settings file {bad}); stopping the spswapd of "
            f"{cfg.root} anyway") in " ".join(r.stderr.split()), r.stderr  # fmt: skip
    assert lifecycle.daemon_running(cfg) is None
    r = run("daemon", "start")
    assert r.returncode == 2 and "SPSWAP_KEEP_ON_GPU='maybe'" in r.stderr


def test_events_without_a_log(cfg: Config) -> None:
    assert json.loads(spswap(cfg, "events", "--json").stdout) == []
    assert "no events yet" in spswap(cfg, "events").stdout


def test_node_help_explains_exit_code(cfg: Config) -> None:
    out = spswap(cfg, "node", "prolog", "--help").stdout
    assert "Always exits 0" in out and "prolog.log" in out


def test_images_rm_through_a_running_spswapd(cfg: Config, daemon: int) -> None:
    """`spswap images rm JOB` as root: the real spswapd deletes the job's image and says
    so (text and --json), and a job without one is told so."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("images rm is root's")
    image = cfg.paths.images / "job41-aaaa-bbbb"
    image.mkdir(parents=True)
    (image / "pages-1.img").write_bytes(b"x")
    r = spswap(cfg, "images", "rm", "41")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (f"deleted job 41's checkpoint image ({image.name}): its next "
                                "run here starts from the pool")  # fmt: skip
    assert not image.exists()
    r = spswap(cfg, "images", "rm", "41", "--json")
    assert json.loads(r.stdout) == {"job_id": "41", "found": False, "images_deleted": [],
                                    "kept_ended": False}  # fmt: skip
    assert "job 41 has no checkpoint image on this node" in spswap(cfg, "images", "rm", "41").stdout
    kinds = [e["kind"] for e in json.loads(spswap(cfg, "events", "--json").stdout)]
    assert kinds.count("images.removed") == 1
