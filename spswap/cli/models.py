"""``spswap models``: make a model the reference engine serves; check which engine serves
a model directory."""

from __future__ import annotations

from pathlib import Path

import typer

from spswap.cli.common import JsonOpt, console, emit_json
from spswap.engines.model_check import check_servable
from spswap.engines.vllm_engine import available
from spswap.errors import ConfigError
from spswap.install_hint import needs_torch, pip_install_hint
from spswap.units import fmt_bytes

app = typer.Typer(
    help=(
        "Models to serve. The reference engine (`spswap serve MODEL`, the default) serves "
        "the small random-weight transformers `spswap models make` writes; vLLM (`spswap "
        "serve MODEL --engine vllm`) serves Hugging Face-style models (config.json naming "
        "architectures, *.safetensors weights)."
    ),
    no_args_is_help=True,
)

PRESETS_HELP = (
    "Size: tiny (~10 MB, F32), small (~80 MB, F32), 1g (~1.1 GB, BF16), 4g (~4 GB, BF16); "
    "F32 ones suit a CPU, BF16 ones a GPU."
)


@app.command("make")
def make(
    directory: Path = typer.Argument(
        ..., metavar="DIR", help="Where to write the model: a new or empty directory."
    ),
    preset: str = typer.Option("small", "--preset", help=PRESETS_HELP),
    seed: int = typer.Option(
        0, "--seed", min=0, help="Seed of the random weights: the same seed makes the same "
        "model (and the same answers); another seed, another model of the same size.",
    ),
    json_out: bool = JsonOpt,
) -> None:  # fmt: skip
    """Write a model the reference engine serves: config.json + model.safetensors in DIR.

    Its weights are random (drawn from --seed), so its answers are token ids with no
    meaning, but they are deterministic: the same model answers the same prompt the same
    way before and after a swap, a preemption or a restore. Serve it in a Slurm job with
    `spswap serve DIR` (sbatch_templates/serve.sbatch: MODEL=DIR). Needs torch.
    """
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ConfigError(
            f"{directory} exists and is not an empty directory: give a new directory "
            "(spswap models make writes config.json and model.safetensors there)"
        )
    try:
        from spswap.engines.reference import save_checkpoint
        from spswap.engines.reference_model import preset as make_preset
    except ImportError as e:
        raise ConfigError(needs_torch("making a reference model", e)) from None
    config = make_preset(preset, seed=seed)
    path = save_checkpoint(config, directory).resolve()
    out = {
        "path": str(path), "engine": "reference", "preset": preset, "seed": seed,
        "weight_bytes": config.weight_bytes, "config": config.to_json(),
    }  # fmt: skip
    if json_out:
        emit_json(out)
        return

    console.print(
        f"made {path}: reference model, preset {preset}, seed {seed}, "
        f"{fmt_bytes(config.weight_bytes)} ({config.dtype}), token ids 0..{config.vocab_size - 1}, "
        f"at most {config.max_seq_len} tokens per prompt + answer\n"
        f"serve it in a Slurm job: spswap serve {path}\n"
        f"(or MODEL={path} in your copy of sbatch_templates/serve.sbatch)",
        markup=False, soft_wrap=True,
    )  # fmt: skip


@app.command("check")
def check(
    directory: Path = typer.Argument(..., metavar="DIR", help="The model's directory."),
    engine: str = typer.Option(
        "reference", "--engine", help="The engine to check for: reference or vllm."
    ),
    json_out: bool = JsonOpt,
) -> None:
    """Say whether ENGINE can serve the model in DIR, before a job is submitted for it.

    `spswap serve` makes the same check before it imports the model into the node's
    pool. Exits 2, naming the engine that serves the model, when this one cannot. The
    reference engine's check needs torch.
    """
    if not directory.is_dir():
        raise ConfigError(f"{directory} is not a directory; a model is a directory")
    check_servable(engine, directory)
    # the check reads the files only; a job's node needs vLLM itself (often not this host)
    vllm_here = engine == "vllm" and available()
    if json_out:
        emit_json({"path": str(directory.resolve()), "engine": engine, "ok": True,
                   **({"vllm_installed": vllm_here} if engine == "vllm" else {})})  # fmt: skip
        return
    flag = "" if engine == "reference" else " --engine vllm"
    what = "" if engine == "reference" else " (vLLM itself checks the rest when it loads it)"
    console.print(f"ok: `spswap serve {directory}{flag}` can serve it{what}",
                  markup=False, soft_wrap=True)  # fmt: skip
    if engine == "vllm" and not vllm_here:
        console.print("note: vLLM is not installed in this Python; the nodes that run the "
                      f"job need it (`{pip_install_hint('vllm')}` there)", markup=False,
                      soft_wrap=True)  # fmt: skip
