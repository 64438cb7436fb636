"""Placeholder sub-app; replaced by the module that owns 'bench'."""

import typer

app = typer.Typer(help="bench commands", no_args_is_help=True)
