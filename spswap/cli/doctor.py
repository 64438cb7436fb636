"""``spswap doctor``: check this node for model swapping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from spswap.cli.common import JsonOpt, RootOpt, emit, err_console, load_config
from spswap.doctor import collect, failed_checks
from spswap.plain import fits_unwrapped

StrictOpt = typer.Option(
    False,
    "--strict",
    help="Exit with status 1 when a check fails (FAIL; a warning does not): for install scripts.",
)


def doctor(json: bool = JsonOpt, root: Path | None = RootOpt, strict: bool = StrictOpt) -> None:
    """Check this node: CRIU version and `criu check`, kernel, io_uring sysctl, NVIDIA driver
    (>= 570 for checkpoint, >= 580 to restore onto another GPU), persistence mode, the tmpfs
    under SPSWAP_ROOT and whether it holds the pool in huge pages (faster CUDA restores on a
    GPU node), cgroup mode and whether a dumped tree can be moved out of its job's cgroup,
    the node's budgets and settings, whether the daemon runs, torch (the reference engine's)
    and vLLM, and whether spswap's bytecode is compiled for users' runs. Warnings (ok null in
    --json) say what to do; FAIL is what swapping cannot work without.

    As root it also test-dumps and restores a short-lived process of another uid (nobody)
    the way spswapd dumps a job's: CRIU as that user in --unprivileged mode, and root's
    CRIU too when SPSWAP_CRIU_AS_ROOT=1 selects it; a failure shows CRIU's first error and
    what the node lacks (e.g. "Can't get rlimit": root without CAP_SYS_RESOURCE). It says
    where the kernel (no CAP_CHECKPOINT_RESTORE before Linux 5.9) or the GPU device files
    refuse the unprivileged mode.

    Run it as root for `criu check` and the test dumps. Exits 0 unless --strict and a
    check fails.
    """
    report = collect(load_config(root))
    emit(report, json, render)
    failed = failed_checks(report)
    if strict and failed:
        names = ", ".join(c["name"] for c in failed)
        err_console.print(f"checks failed: {names}")
        raise typer.Exit(1)


MARKS = {True: "[green]ok[/]", False: "[red]FAIL[/]", None: "[yellow]warn[/]"}


def render(report: dict[str, Any]) -> FittedReport:
    """One row per check, a mark, the value and what to do: a table where its rows fit
    the terminal unwrapped, else a line a check (at 80 columns the table's four columns
    folded every path and setting name mid-word)."""
    return FittedReport(report)


class FittedReport:
    """The doctor's report as :func:`render` describes it, laid out at render time."""

    def __init__(self, report: dict[str, Any]) -> None:
        self.report = report

    def table(self) -> Table:
        table = Table(title=f"spswap doctor: {self.report['node']}", title_justify="left")
        for col in ("check", "", "value", "what to do"):
            table.add_column(col, overflow="fold")
        for c in self.report["checks"]:
            table.add_row(escape(c["name"]), MARKS[c["ok"]], escape(c["value"]),
                          escape(c["detail"]))  # fmt: skip
        return table

    def lines(self) -> Group:
        """``MARK  name: value`` a check, ``what to do: ...`` under it; a long line goes on
        under its own start, not at the margin (it read as a row of its own)."""
        grid = Table.grid(padding=(0, 1))
        grid.add_column(no_wrap=True, width=4)
        grid.add_column(overflow="fold")
        for c in self.report["checks"]:
            grid.add_row(Text.from_markup(MARKS[c["ok"]]), Text(f"{c['name']}: {c['value']}"))
            if c["detail"]:
                grid.add_row("", Text(f"what to do: {c['detail']}"))
        return Group(Text(f"spswap doctor: {self.report['node']}"), grid)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        table = self.table()
        yield table if fits_unwrapped(console, options, table) else self.lines()
