"""Placeholder sub-app; replaced by the module that owns 'pool'."""

import typer

app = typer.Typer(help="pool commands", no_args_is_help=True)
