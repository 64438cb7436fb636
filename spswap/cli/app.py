"""The ``spswap`` command: one typer app with a sub-app per piece."""

from __future__ import annotations

import typer

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
    serve_app,
    slots,
    status,
)

app = serve_app.make_app(
    help=(
        "Slurm-native model swapping for vLLM on shared GPU nodes: a node-wide weight "
        "pool on tmpfs, GPU slot reservations, and checkpoint/restore of model processes."
    ),
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
serve_app.register(app)
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
    serve_app.run_app(app)
