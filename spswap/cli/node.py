"""``spswap node``: the Slurm Prolog/Epilog entry points (run by slurmd as root)."""

from __future__ import annotations

import typer

from spswap.node import epilog as run_epilog
from spswap.node import prolog as run_prolog

app = typer.Typer(
    help=(
        "Slurm Prolog/Epilog entry points, run by slurmd as root (through slurm/prolog.sh "
        "and slurm/epilog.sh). They exit 0 even when spswap itself has trouble: a failing "
        "prolog would drain the node, so problems go to $SPSWAP_ROOT/log/prolog.log and "
        "epilog.log instead."
    ),
    no_args_is_help=True,
)


@app.command("prolog")
def prolog() -> None:
    """Ensure the node daemon spswapd runs (started detached, so it survives slurmd's
    clean-up of the prolog) and record the job's id, user, GPUs and restart count.
    Always exits 0 for spswap's own trouble (logged to log/prolog.log); exits 2 only
    when run outside a Slurm job (no SLURM_JOB_ID)."""
    raise typer.Exit(run_prolog())


@app.command("epilog")
def epilog() -> None:
    """Release what the job held on this node (slot reservations, pool uses) and mark it
    ended; the pool and checkpoint images stay for later (requeued) jobs. Always exits 0
    for spswap's own trouble (logged to log/epilog.log); 2 outside a Slurm job."""
    raise typer.Exit(run_epilog())
