"""The ``spswap`` command line (typer + rich)."""
