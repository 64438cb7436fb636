"""``spswap doctor``: check this node for model swapping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from spswap.cli.common import JsonOpt, RootOpt, emit, err_console, load_config
from spswap.doctor import collect, failed_required

StrictOpt = typer.Option(
    False, "--strict", help="Exit with status 1 when a required check fails (for CI and prologs)."
)


def doctor(json: bool = JsonOpt, root: Path | None = RootOpt, strict: bool = StrictOpt) -> None:
    """Check this node: CRIU version and `criu check`, kernel, io_uring sysctl, NVIDIA driver
    (>= 570 for checkpoint, >= 580 to restore onto another GPU), persistence mode, the tmpfs
    under SPSWAP_ROOT and whether it holds the pool in huge pages (faster CUDA restores on a
    GPU node), cgroup mode and whether a dumped tree can be moved out of its job's cgroup,
    vLLM, and whether the daemon runs.

    As root it also test-dumps and restores a short-lived process of another uid (nobody)
    the way spswapd dumps a job's: CRIU as that user in --unprivileged mode, and root's
    CRIU too when SPSWAP_CRIU_AS_ROOT=1 selects it; a failure shows CRIU's first error and
    what the node lacks (e.g. "Can't get rlimit": root without CAP_SYS_RESOURCE). It says
    where the kernel (no CAP_CHECKPOINT_RESTORE before Linux 5.9) or the GPU device files
    refuse the unprivileged mode.

    Run it as root for `criu check` and the test dumps. Exits 0 unless --strict and a
    required check fails.
    """
    report = collect(load_config(root))
    emit(report, json, render)
    failed = failed_required(report)
    if strict and failed:
        names = ", ".join(c["name"] for c in failed)
        err_console.print(f"required checks failed: {names}")
        raise typer.Exit(1)


def render(report: dict[str, Any]) -> Table:
    """A rich table: one row per check, a mark, the value and what to do."""
    marks = {True: "[green]ok[/]", False: "[red]FAIL[/]", None: "[yellow]warn[/]"}
    table = Table(title=f"spswap doctor: {report['node']}", title_justify="left")
    for col in ("check", "", "value", "what to do"):
        table.add_column(col, overflow="fold")
    for c in report["checks"]:
        table.add_row(escape(c["name"]), marks[c["ok"]], escape(c["value"]), escape(c["detail"]))
    return table
