"""``spswap demo``: small models take turns on this machine's device through a real
spswapd (CRIU where it can, the pool otherwise), every answer checked against cold."""

from __future__ import annotations

from pathlib import Path

import typer

from spswap.cli.common import JsonOpt, console, emit_json, err_console
from spswap.errors import ConfigError
from spswap.install_hint import needs_torch


def demo(
    models: int = typer.Option(3, min=2, help="How many models take turns."),
    rounds: int = typer.Option(2, min=1, help="Rounds of turns after the cold starts."),
    preset: str = typer.Option(
        "small", help="Model size: tiny (~10 MB), small (~80 MB), 1g, 4g (BF16, for GPUs)."
    ),
    device: str = typer.Option(
        None, help="Device to serve on, e.g. cpu or cuda:0 (default: the GPU when present)."
    ),
    root: Path = typer.Option(
        None,
        help="Where the temporary node (models, spswapd's root, pool, images) goes "
        "(default: /dev/shm).",
    ),
    json: bool = JsonOpt,
) -> None:
    """Show the main job on this machine: models take turns on one device.

    Writes MODELS small random-weight models, starts a real spswapd on a temporary root
    and plays each model's Slurm job itself (no Slurm needed): each model starts cold
    once (its answer is the reference), then ROUNDS rounds of turns follow, where the
    demo stops the running model's `spswap serve` (SIGTERM, as Slurm's requeue does)
    and starts the next model's next run. As root with CRIU >= 4.1 spswapd checkpoints
    each stopped server (kept alive or to an image) and the next run restores it;
    otherwise the runs start from the pool, and the demo says what to run for the
    checkpoint path. Prints every turn's path and time (stop -> first answer) against
    the cold starts. Exits 1 if any answer differs. Everything is removed at the end.
    Needs torch: an install without --no-torch (`spswap doctor`'s torch row).
    """
    try:
        import torch  # noqa: F401 - the servers and the models need it

        from spswap.demo import run_demo
        from spswap.demo_report import demo_json, demo_ok, render_demo
    except ImportError as e:  # (said as every command's refusal: --json's error object)
        raise ConfigError(needs_torch("the demo", e)) from None
    progress = None if json else (lambda msg: err_console.print(f"[dim]{msg}[/]"))
    summary, mode = run_demo(models=models, rounds=rounds, preset=preset, device=device,
                             root=root, progress=progress)  # fmt: skip
    if json:
        emit_json(demo_json(summary, mode))
    else:
        console.print(render_demo(summary, mode))
    if not demo_ok(summary):
        raise typer.Exit(1)
