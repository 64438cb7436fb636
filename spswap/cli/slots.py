"""Placeholder sub-app; replaced by the module that owns 'slots'."""

import typer

app = typer.Typer(help="slots commands", no_args_is_help=True)
