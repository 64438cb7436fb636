"""Placeholder sub-app; replaced by the module that owns 'daemon'."""

import typer

app = typer.Typer(help="daemon commands", no_args_is_help=True)
