"""The `spswap` commands themselves, run as a second real uid: writes go through spswapd."""

from __future__ import annotations

import json
from typing import Any

from typer.testing import CliRunner

from spswap.cli.app import app
from spswap.config import Config
from spswap.daemon.client import Client
from spswap.slots.table import SlotTable
from tests.security.conftest import TEST_USER, as_user


def _cli(cfg: Config, *args: str) -> dict[str, Any]:
    """Run the command tree in this (user) process: the venv's interpreter lives under
    root's home, which the other uid cannot exec."""
    r = CliRunner().invoke(app, [*args, "--root", str(cfg.root)])
    return {"code": r.exit_code, "out": r.stdout, "error": repr(r.exception)}


def _warm_up(cfg: Config) -> None:
    """Load every module the commands need while still root: after the switch to the
    other uid, root's Python installation (under /root) cannot be read any more."""
    _cli(cfg, "slots", "reserve", "--help")
    _cli(cfg, "slots", "release", "--help")
    _cli(cfg, "slots", "reserve", "--model", "warm", "--units", "3")  # refused: reserves nothing
    import spswap.access  # noqa: F401
    import spswap.daemon.client  # noqa: F401


def _spswap_as(uid: int, cfg: Config, *args: str) -> dict[str, Any]:
    result: dict[str, Any] = as_user(uid, _cli, cfg, *args)
    return result


def test_user_cli_reserves_and_releases_through_the_daemon(
    cfg: Config, daemon: int, user_uid: int
) -> None:
    Client(cfg).call("job.register", job_id="300", uid=user_uid, user=TEST_USER)
    _warm_up(cfg)
    res = _spswap_as(
        user_uid,
        cfg,
        "slots",
        "reserve",
        "--model",
        "m",
        "--units",
        "2",
        "--job-id",
        "300",
        "--json",
    )
    assert res["code"] == 0, res
    made = json.loads(res["out"])
    assert made["holder"]["uid"] == user_uid and made["holder"]["job_id"] == "300"
    # held by the job (alive: registered and running), although the command has exited;
    # asked of the daemon, which knows the job (no Slurm controller runs here)
    held = Client(cfg).call("slots.list")["reservations"]
    assert [r["id"] for r in held] == [made["id"]]
    other = _spswap_as(user_uid, cfg, "slots", "reserve", "--model", "m", "--job-id", "999")
    assert other["error"].startswith("PermissionDenied(") and "not registered" in other["error"]
    done = _spswap_as(user_uid, cfg, "slots", "release", made["id"])
    assert done["code"] == 0, done
    assert SlotTable(cfg.paths.slots, [0, 1]).reservations() == []


def test_images_ls_as_a_user_says_the_images_are_roots(cfg: Config, daemon: int,
                                                       user_uid: int) -> None:  # fmt: skip
    """A plain error naming where users see their checkpoints (it was a usage error box:
    "Invalid value")."""
    _cli(cfg, "images", "ls")  # (modules loaded as root)
    cfg.paths.images.mkdir(mode=0o700, exist_ok=True)  # (as spswapd's first dump makes it)
    res = _spswap_as(user_uid, cfg, "images", "ls")
    assert res["error"].startswith("PermissionDenied("), res  # (spswap's one error line)
    assert "is root's: run as root (users see their jobs' checkpoint state in `spswap " \
        "status` and `spswap events`)" in res["error"], res  # fmt: skip


def test_daemon_stop_as_a_user_is_refused_not_told_not_running(cfg: Config, daemon: int,
                                                               user_uid: int) -> None:  # fmt: skip
    """A user's `spswap daemon stop` printed "spswapd was not running" and exited 0 while
    root's spswapd ran (she may not read its pid file; newcomer walk)."""
    _cli(cfg, "daemon", "stop", "--help")  # (modules loaded as root)
    res = _spswap_as(user_uid, cfg, "daemon", "stop")
    assert res["error"].startswith("PermissionDenied("), res
    assert "only root stops it" in res["error"] and "not running" not in res["out"], res
    assert Client(cfg).call("status")["pid"] == daemon  # still the same daemon


def test_daemon_ensure_as_a_user_sees_roots_running_daemon(cfg: Config, daemon: int,
                                                          user_uid: int) -> None:  # fmt: skip
    """A user's `spswap daemon ensure` with root's spswapd running tried to start another
    and failed on its lock ("permission denied", exit 3; admin walk): root's daemon, seen
    without its pid, answers, so there is nothing to start."""
    _cli(cfg, "daemon", "ensure", "--help")  # (modules loaded as root)
    res = _spswap_as(user_uid, cfg, "daemon", "ensure")
    assert res["code"] == 0 and res["out"] == "", res
    assert Client(cfg).call("status")["pid"] == daemon  # the same daemon


def test_daemon_start_as_a_user_says_whose_it_is(cfg: Config, daemon: int,
                                                 user_uid: int) -> None:  # fmt: skip
    """A user's `spswap daemon start` said "cannot use .../spswapd.start.lock: permission
    denied" whether root's spswapd ran or not (a walk): now it says it runs (exit 0), and
    when it does not, that only root starts it."""
    from spswap.daemon import lifecycle

    _cli(cfg, "daemon", "start", "--help")  # (modules loaded as root)
    res = _spswap_as(user_uid, cfg, "daemon", "start")
    assert res["code"] == 0, res
    assert " ".join(res["out"].split()) == (
        f"spswapd already running (root's: only root starts and stops it; socket "
        f"{cfg.paths.socket})"
    )
    assert Client(cfg).call("status")["pid"] == daemon  # the same daemon
    lifecycle.stop(cfg)
    res = _spswap_as(user_uid, cfg, "daemon", "start")
    assert res["error"].startswith("PermissionDenied("), res
    assert (f"spswapd for {cfg.root} is root's and is not running: only root starts it (the "
            "Slurm prolog does at a job's start; `sudo spswap daemon start`, or ask the "
            "node's admin)") in res["error"], res  # fmt: skip
    assert lifecycle.daemon_running(cfg) is None
