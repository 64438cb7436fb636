"""The ``spswap`` command: one typer app with a sub-app per piece."""

from __future__ import annotations

import sys

import typer
from rich.markup import escape

from spswap import __version__
from spswap.cli import (
    ask,
    bench,
    daemon,
    demo,
    doctor,
    events,
    help_style,
    images,
    models,
    node,
    pool,
    serve,
    slots,
    status,
)
from spswap.cli.common import err_console
from spswap.errors import SpswapError

app = typer.Typer(
    name="spswap",
    help=(
        "Slurm-native model swapping for vLLM on shared GPU nodes: a node-wide weight "
        "pool on tmpfs, GPU slot reservations, and checkpoint/restore of model processes."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="markdown",
)
app.add_typer(pool.app, name="pool")
app.add_typer(models.app, name="models")
app.add_typer(slots.app, name="slots")
app.add_typer(bench.app, name="bench")
app.add_typer(daemon.app, name="daemon")
app.add_typer(node.app, name="node")
app.add_typer(images.app, name="images")
app.command("status")(status.status)
app.command("demo")(demo.demo)
app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
    serve.serve
)
app.command("ask")(ask.ask)
app.command("doctor")(doctor.doctor)
app.command("events")(events.events)
help_style.apply(app)  # --help: "[OPTIONS] MODEL", no "<bool>" after a flag


def _version(value: bool) -> None:
    if value:
        typer.echo(f"spswap {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """spswap: swap models on shared GPU nodes in seconds, not minutes."""


def main() -> None:
    """Console-script entry point: spswap's own errors print as one clear message."""
    try:
        app()
    except SpswapError as e:
        # the message is text, not markup: "spswap[torch]" must print as written
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", markup=True, soft_wrap=True)
        sys.exit(e.exit_code)
