"""Placeholder sub-app; replaced by the module that owns 'images'."""

import typer

app = typer.Typer(help="images commands", no_args_is_help=True)
