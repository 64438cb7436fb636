"""``spswap bench prolog``: what ``spswap node prolog`` costs a job start.

Runs the real ``spswap`` executable as slurmd would (a new process each time, an
environment with the job's variables and no PATH) while the daemon runs, and times
each run end to end, Python start-up included. Each timed prolog is followed by an
untimed epilog so the bench leaves no running jobs behind.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from spswap.config import Config
from spswap.daemon import lifecycle
from spswap.users import user_name

TARGET_MS = 100.0
"""The prolog's budget when the daemon already runs."""


def spswap_executable() -> str:
    """The ``spswap`` next to this Python (a venv), else the one on PATH."""
    beside = Path(sys.executable).parent / "spswap"
    if beside.exists():
        return str(beside)
    found = shutil.which("spswap")
    if found is None:
        raise FileNotFoundError("no spswap executable beside this Python or on PATH")
    return found


def current_user_name() -> str:
    """This process's user by name (root's too: $USER is unset under sudo -i, su -c), else
    the uid as text where the user database does not know it."""
    return user_name(os.getuid()) or str(os.getuid())


def prolog_env(cfg: Config, job_id: str) -> dict[str, str]:
    """The environment slurmd gives a prolog (no PATH), for a job of the current user."""
    user = current_user_name()
    return {
        "SPSWAP_ROOT": str(cfg.root),
        "SLURM_JOB_ID": job_id,
        "SLURM_JOB_UID": str(os.getuid()),
        "SLURM_JOB_USER": user,
        "SLURM_JOB_GPUS": "0",
        "CUDA_VISIBLE_DEVICES": "0",
        "SLURM_JOB_RESTART_COUNT": "0",
    }


def _pct(sorted_ms: list[float], q: float) -> float:
    return sorted_ms[min(len(sorted_ms) - 1, max(0, round(q * (len(sorted_ms) - 1))))]


def bench_prolog(
    cfg: Config, *, iterations: int = 20, argv: list[str] | None = None
) -> dict[str, Any]:
    """Time ``iterations`` runs of ``spswap node prolog`` with spswapd running. A daemon
    this run had to start for ``cfg``'s root is stopped again at its end (``daemon``:
    ``"running"`` or ``"started and stopped"``): the bench leaves the node as it found it."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    argv = argv or [spswap_executable(), "node", "prolog"]
    was_running = lifecycle.daemon_running(cfg)
    started = not (was_running and was_running > 0)  # (a daemon there, answering or not, stays)
    lifecycle.ensure(cfg)
    try:
        result = _time_prologs(cfg, argv, iterations)
    finally:
        if started:
            lifecycle.stop(cfg)
    return {**result, "daemon": "started and stopped" if started else "running"}


def _time_prologs(cfg: Config, argv: list[str], iterations: int) -> dict[str, Any]:
    epilog_argv = [*argv[:-1], "epilog"]
    tag = f"bench{os.getpid()}"
    times_ms: list[float] = []
    failures = 0
    devnull = subprocess.DEVNULL
    quiet = {"stdin": devnull, "stdout": devnull, "stderr": devnull}
    for i in range(iterations + 1):  # run 0 warms the page cache and is not counted
        env = prolog_env(cfg, f"{tag}_{i}")
        t0 = time.perf_counter()
        rc = subprocess.run(argv, env=env, **quiet).returncode  # type: ignore[call-overload]
        elapsed_ms = (time.perf_counter() - t0) * 1000.0
        subprocess.run(epilog_argv, env=env, **quiet)  # type: ignore[call-overload]
        if i == 0:
            continue
        failures += rc != 0
        times_ms.append(elapsed_ms)
    s = sorted(times_ms)
    p50 = statistics.median(s)
    return {
        "command": " ".join(argv),
        "iterations": iterations,
        "failures": failures,
        "p50_ms": round(p50, 2),
        "p90_ms": round(_pct(s, 0.9), 2),
        "max_ms": round(s[-1], 2),
        "min_ms": round(s[0], 2),
        "target_ms": TARGET_MS,
        "meets_target": p50 <= TARGET_MS and failures == 0,
    }


def render_bench_prolog(result: dict[str, Any]) -> Table:
    """The result as a one-row table with the verdict in the title."""
    verdict = "meets" if result["meets_target"] else "MISSES"
    table = Table(
        title=f"spswap node prolog, daemon running: {verdict} the {result['target_ms']:g} ms "
        f"target at p50 ({result['iterations']} runs, {result['failures']} failed)",
        title_justify="left",
    )
    for col in ("p50 ms", "p90 ms", "max ms", "min ms"):
        table.add_column(col, justify="right")
    table.add_row(*(f"{result[k]:.1f}" for k in ("p50_ms", "p90_ms", "max_ms", "min_ms")))
    table.caption = result["command"] + (
        "\n(spswapd was started for these runs and stopped after them)"
        if result.get("daemon") == "started and stopped" else ""
    )  # fmt: skip
    return table
