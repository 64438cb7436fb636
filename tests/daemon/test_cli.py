"""`spswap daemon ...`, `spswap events` and `spswap node --help`, through the real CLI."""

from __future__ import annotations

import json
import os
import subprocess

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
    assert "spswap daemon start" in json.loads(r.stdout)["problem"]
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
    events = json.loads(spswap(cfg, "events", "--json", "-n", "5").stdout)
    assert [e["kind"] for e in events] == ["daemon.start"]
    assert "daemon.start" in spswap(cfg, "events").stdout
    r = spswap(cfg, "daemon", "stop")
    assert r.returncode == 0 and f"spswapd stopped (was pid {pid})" in r.stdout
    assert spswap(cfg, "daemon", "stop").stdout.strip() == "spswapd was not running"


def test_events_without_a_log(cfg: Config) -> None:
    assert json.loads(spswap(cfg, "events", "--json").stdout) == []
    assert "no events yet" in spswap(cfg, "events").stdout


def test_node_help_explains_exit_code(cfg: Config) -> None:
    out = spswap(cfg, "node", "prolog", "--help").stdout
    assert "Always exits 0" in out and "prolog.log" in out
