"""The ``spswap`` console script (``[project.scripts]`` in pyproject.toml) and
``python -m spswap.cli``.

``spswap node prolog`` must cost <= 100 ms with Python's start-up included, and the
full CLI's imports (typer, rich, click) alone take more than half of that. So this
module serves ``node prolog`` / ``node epilog`` from :mod:`spswap.node` first, ``spswap
serve`` from :mod:`spswap.cli.serve_app` (that command alone: a requeued run's start is on
the swap's path; in a Slurm job it tells spswapd first that the run starts), and loads
the typer app (:mod:`spswap.cli.app`) for every other command.
It must never import typer, rich, click or torch at module level.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

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


def tell_run_starts(argv: list[str], env: Mapping[str, str]) -> bool:
    """``spswap serve`` in a Slurm job: tell spswapd, before the imports (a few tenths of a
    second), that a run of the job starts, so that its kept instance's GPU state comes
    back meanwhile where no prolog started that (``job.starting``). Sent without waiting
    for the answer; True when sent. Nothing else depends on it: any failure is silent
    (the run's restore does the same, later)."""
    if argv[:1] != ["serve"] or not env.get("SLURM_JOB_ID"):
        return False
    if any(a in ("--help", "-h") or a.startswith("--root") for a in argv):
        return False  # (another root's daemon: serve itself finds it)
    try:
        from spswap.config import Config
        from spswap.daemon.client import Client

        Client(Config.load(env), timeout_s=0.5).notify("job.starting",
                                                       job_id=env["SLURM_JOB_ID"])  # fmt: skip
    except Exception:  # noqa: BLE001 - a hint: the run goes on without it
        return False
    return True


def main() -> None:
    """Console-script entry: the Slurm hooks before typer and rich, else the app."""
    code = fast_main(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    # off the fast path only: the app pulls in typer, rich and click
    if sys.argv[1:2] == ["serve"]:  # a requeued run's start: on the swap's path
        tell_run_starts(sys.argv[1:], os.environ)
        from spswap.cli.serve_app import main as serve_main

        serve_main()
        return
    from spswap.cli.app import main as app_main

    app_main()
