"""Placeholder sub-app; replaced by the module that owns 'node'."""

import typer

app = typer.Typer(help="node commands", no_args_is_help=True)
