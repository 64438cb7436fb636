"""``spswap demo``: swap small random models through a temporary pool and check answers."""

from __future__ import annotations

from pathlib import Path

import typer

from spswap.cli.common import JsonOpt, console, emit_json, err_console


def demo(
    models: int = typer.Option(2, min=1, help="How many models to swap."),
    rounds: int = typer.Option(3, min=1, help="How many times each model is woken."),
    preset: str = typer.Option(
        "small", help="Model size: tiny (~10 MB), small (~80 MB), 1g, 4g (BF16, for GPUs)."
    ),
    device: str = typer.Option(
        None, help="Device to swap on, e.g. cpu or cuda:0 (default: the GPU when present)."
    ),
    root: Path = typer.Option(
        None, help="Where the temporary checkpoints and pool go (default: /dev/shm)."
    ),
    json: bool = JsonOpt,
) -> None:
    """Run the whole swap path on this machine, no Slurm or vLLM needed.

    Creates MODELS small random-weight transformers as safetensors checkpoints in a
    temporary folder, loads each cold once to record its greedy answers, imports them into
    a pool under a temporary root, then swaps them on one device for ROUNDS rounds (wake
    from the pool, answer, sleep). Prints cold-load vs pool-restore times per model and
    whether every answer equals the cold answer. Exits 1 if any answer differs.
    Everything it writes is removed at the end.
    """
    try:
        from spswap.demo import render_demo, run_demo
    except ImportError as e:
        err_console.print(
            f"error: the demo needs torch ({e}); install it with: pip install 'spswap[torch]'",
            markup=False, style="bold red", soft_wrap=True,
        )  # fmt: skip
        raise typer.Exit(2) from None
    progress = None if json else (lambda msg: err_console.print(f"[dim]{msg}[/]"))
    result = run_demo(
        models=models, rounds=rounds, preset=preset, device=device, root=root,
        progress=progress,
    )  # fmt: skip
    if json:
        emit_json(result.to_json())
    else:
        console.print(render_demo(result))
    if not result.all_equal:
        raise typer.Exit(1)
