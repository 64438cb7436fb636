"""The ``spswap`` console script (``[project.scripts]`` in pyproject.toml) and
``python -m spswap.cli``.

``spswap node prolog`` must cost <= 100 ms with Python's start-up included, and the
full CLI's imports (typer, rich, click) alone take more than half of that. So this
module serves ``node prolog`` / ``node epilog`` from :mod:`spswap.node` first, ``spswap
serve`` from :mod:`spswap.cli.serve_app` (that command alone: a requeued run's start is on
the swap's path), and loads the typer app (:mod:`spswap.cli.app`) for every other command.
It must never import typer, rich, click or torch at module level.
"""

from __future__ import annotations

import sys

from spswap import node


def fast_main(argv: list[str]) -> int | None:
    """Handle ``node prolog`` / ``node epilog`` (no options) without loading the CLI.

    Returns the exit code, or None when ``argv`` is anything else (``--help`` too):
    the caller then runs the full typer app.
    """
    if argv == ["node", "prolog"]:
        return node.prolog()
    if argv == ["node", "epilog"]:
        return node.epilog()
    return None


def main() -> None:
    """Console-script entry: the Slurm hooks before typer and rich, else the app."""
    code = fast_main(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    # off the fast path only: the app pulls in typer, rich and click
    if sys.argv[1:2] == ["serve"]:  # a requeued run's start: on the swap's path
        from spswap.cli.serve_app import main as serve_main

        serve_main()
        return
    from spswap.cli.app import main as app_main

    app_main()
