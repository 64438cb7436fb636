"""``spswap daemon``: start, stop, inspect and ensure the node daemon spswapd."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from spswap.cli.common import JsonOpt, RootOpt, console, emit_json, err_console, load_config
from spswap.config import Config
from spswap.daemon import lifecycle
from spswap.daemon.client import Client
from spswap.daemon.main import run as run_daemon
from spswap.errors import ConfigError, DaemonError
from spswap.settings_check import settings_problems
from spswap.settings_file import settings_file_path

app = typer.Typer(
    help=(
        "The per-node daemon spswapd (root): owns the pool and the privileged operations, "
        "serves $SPSWAP_ROOT/run/spswapd.sock. The Slurm prolog starts it when needed."
    ),
    no_args_is_help=True,
)

WaitOpt = typer.Option(10.0, "--wait-s", min=0.1, help="Seconds to wait for it to answer.")


@app.command("start")
def start(root: Path | None = RootOpt, wait_s: float = WaitOpt) -> None:
    """Start spswapd detached (its own session, output to log/spswapd.log, a clean
    environment: the settings only) unless it already runs; waits until it answers on
    its socket. It reads /etc/default/spswap (or the file $SPSWAP_DEFAULTS names) as every
    command does; the settings this node cannot hold are printed as warnings."""
    cfg = load_config(root)
    before = lifecycle.daemon_running(cfg)
    pid = lifecycle.start(cfg, wait_s=wait_s)
    if pid < 0:  # root's, seen by a user (who may not read its pid)
        console.print(f"spswapd already running (root's: only root starts and stops it; "
                      f"socket {cfg.paths.socket})", markup=False, soft_wrap=True)  # fmt: skip
        return
    word = "already running" if before == pid else "started"
    console.print(f"spswapd {word} (pid {pid}, socket {cfg.paths.socket})", markup=False)
    _warn_settings(cfg)


def _warn_settings(cfg: Config) -> None:
    """Where the settings came from, and those this node cannot hold (with the numbers)."""
    import os

    path = settings_file_path(os.environ)
    console.print(_settings_line(path, "the"), markup=False, soft_wrap=True)
    for problem in settings_problems(cfg):
        err_console.print(f"warning: {problem}", markup=False, soft_wrap=True)


def _settings_line(path: Path | str, whose: str) -> str:
    """Where a daemon's settings come from: ``path`` (named absent where it is not on
    this node), then ``whose`` environment's SPSWAP_*."""
    absent = "" if Path(path).exists() else " (absent: the defaults)"
    return f"settings: {path}{absent}, then SPSWAP_* of {whose} environment"


@app.command("stop")
def stop(
    root: Path | None = RootOpt,
    timeout_s: float = typer.Option(10.0, "--timeout-s", help="SIGKILL after this long."),
) -> None:
    """Stop spswapd (SIGTERM, then SIGKILL after --timeout-s). The pool, slots, jobs and
    images stay on tmpfs; the next start carries on with them. Root stops root's spswapd
    (a user is refused, exit 3). A settings file with an error does not keep it running:
    the stop goes on with the root alone, and says what to fix before the next start."""
    try:
        cfg = load_config(root)
    except ConfigError as e:
        cfg = Config.root_only(root=root)
        err_console.print(f"spswap daemon stop: warning: {e}; stopping the spswapd of "
                          f"{cfg.root} anyway: fix the settings before `spswap daemon "
                          "start`", markup=False)  # fmt: skip
    pid = lifecycle.stop(cfg, timeout_s=timeout_s)
    if pid is None:
        console.print("spswapd was not running", markup=False)
    else:
        console.print(f"spswapd stopped (was pid {pid})", markup=False)


@app.command("ensure")
def ensure(root: Path | None = RootOpt, wait_s: float = WaitOpt) -> None:
    """Start spswapd if it is not running. Silent either way (it prints only an error,
    and exits non-zero then); fast (one lock probe and one ping) when it runs.
    Idempotent: safe to run from every prolog and cron job."""
    lifecycle.ensure(load_config(root), wait_s=wait_s)


@app.command("status")
def status(root: Path | None = RootOpt, json: bool = JsonOpt) -> None:
    """Whether spswapd runs, its pid, version, uptime and socket, the settings file it read
    (its own settings are in --json) and the settings it cannot hold. Exits 1 when it is
    not running or does not answer."""
    cfg = load_config(root)
    pid = lifecycle.daemon_running(cfg)
    info: dict[str, object] = {"running": False, "pid": pid, "socket": str(cfg.paths.socket),
                               "log": str(lifecycle.log_path(cfg))}  # fmt: skip
    problem = None
    if pid:
        try:
            info.update(Client(cfg, timeout_s=5.0).call("status"))
            info["running"] = True
        except DaemonError as e:
            problem = f"spswapd holds its pid file (pid {pid}) but does not answer: {e}"
    else:
        # (a newcomer who just brought Slurm up read "start it" as a failure to mend)
        problem = ("spswapd is not running: the Slurm prolog starts it at a job's start on "
                   "this node (root: spswap daemon start)")  # fmt: skip
    if json:
        emit_json({**info, "problem": problem})
    elif problem:
        console.print(problem, markup=False)
    else:
        up = time.strftime("%F %T", time.localtime(float(info["started_at"])))  # type: ignore[arg-type]
        console.print(
            f"spswapd running: pid {info['pid']}, version {info['version']}, protocol "
            f"{info['protocol']}, up since {up} ({info['uptime_s']} s), "
            f"{info['jobs']} job(s) running, socket {info['socket']}", markup=False,
        )  # fmt: skip
        settings = info.get("settings_file")
        # (the daemon runs on this node: its settings file is this node's)
        if isinstance(settings, str):
            console.print(_settings_line(settings, "its"), markup=False, soft_wrap=True)
        problems = info.get("settings_problems")
        for line in problems if isinstance(problems, list) else []:
            err_console.print(f"warning: {line}", markup=False, soft_wrap=True)
    if problem:
        raise typer.Exit(1)


@app.command("run")
def run(root: Path | None = RootOpt) -> None:
    """Run spswapd in the foreground (for systemd: slurm/spswapd.service). Exits 0 at
    once when another spswapd already serves this root."""
    try:
        raise typer.Exit(run_daemon(load_config(root)))
    except DaemonError as e:
        console.print(f"spswapd: {e}", markup=False)
        raise typer.Exit(1) from None
