"""``spswap bench``: side-by-side measurements; docs/benchmarks.md records their output."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import typer

from spswap.bench.swap import (
    DEFAULT_MAX_NEW_TOKENS,
    PACK_HELP,
    bench_settings,
    bench_swap,
    render_bench_swap,
)
from spswap.bench.traffic import TrafficOptions, bench_traffic
from spswap.bench.traffic_plan import RateRow, check_rates, parse_rates, render
from spswap.bench.turns import TurnsOptions, run_turns, slurm_preflight, turns_serve_args
from spswap.cli.bench_inputs import (
    DEFAULT_TURN_PRESETS,
    device_problem,
    make_reference_models,
    parse_floats,
    parse_sizes,
)
from spswap.cli.common import JsonOpt, RootOpt, emit, err_console, load_config
from spswap.daemon.memory_claims import mem_available_bytes
from spswap.engines.model_check import check_engine_name
from spswap.engines.vllm_engine import available
from spswap.errors import ConfigError
from spswap.fsutil import atomic_write_json, fs_sizes
from spswap.install_hint import (
    missing_torch_part,
    needs_torch,
    pip_install_hint,
    vllm_gpu_refusal,
)
from spswap.multi.engine_settings import model_settings

app = typer.Typer(
    help="Benchmarks: models taking turns under Slurm (turns), many models under Poisson "
    "traffic (traffic), transfer throughput, slot reservation latency, prolog cost, vLLM "
    "swap paths.",
    no_args_is_help=True,
)

DEFAULT_SIZES = "64M,256M,1G,4G,16G"


def _progress(line: str) -> None:
    """A bench's progress line, on stderr: stdout holds its report (or its --json)."""
    err_console.print(line, markup=False, highlight=False, soft_wrap=True)


@app.command("transfer")
def transfer(
    sizes: str = typer.Option(
        DEFAULT_SIZES, help="Comma-separated sizes (K/M/G suffixes) of the pool entries to copy."
    ),
    device: str = typer.Option(
        None, help="Target device, e.g. cuda:0 or cpu (default: cuda:0 when present, else cpu)."
    ),
    repeats: int = typer.Option(5, min=1, help="Copies per size and method; the best is kept."),
    scratch_dir: Path | None = typer.Option(
        None,
        help="An existing directory the benchmark's scratch pool is made in, and removed "
        "from after (default: /dev/shm). Not --root: this bench leaves the node's state alone.",
    ),
    json: bool = JsonOpt,
) -> None:
    """Pool -> device copy throughput, side by side with a plain pinned-buffer copy (the
    device's limit) and a pageable copy, in the same run; prints each method's GB/s and the
    pool's ratio to the pinned limit. Needs torch."""
    try:
        from spswap.bench.transfer import bench_transfer, memory_problem, render_bench_transfer
    except ImportError as e:  # torch missing
        raise ConfigError(needs_torch("bench transfer", e)) from e
    import torch

    dev = device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    if (bad := device_problem(dev)) is not None:
        raise ConfigError(bad)
    if dev.startswith("cuda") and not torch.cuda.is_available():
        why = ("this torch was built without CUDA" if torch.version.cuda is None
               else "no GPU is visible here")  # fmt: skip
        raise ConfigError(f"--device {dev}: {why}; use --device cpu, or run on a GPU "
                          "node with a CUDA build of torch")  # fmt: skip
    size_list = parse_sizes(sizes)
    scratch_root = Path(scratch_dir or _shm_or_tmp())
    if not scratch_root.is_dir():  # the scratch pool goes in a directory made under it
        raise ConfigError(f"--scratch-dir {scratch_root}: no such directory; give an existing one "
                          "for the benchmark's scratch pool (a tmpfs such as /dev/shm, where "
                          "the node's pool lives)")  # fmt: skip
    problem = memory_problem(size_list, available_bytes=mem_available_bytes(),
                             scratch=scratch_root,
                             scratch_free_bytes=_free_bytes(scratch_root))  # fmt: skip
    if problem:
        raise ConfigError(problem)
    with tempfile.TemporaryDirectory(prefix="spswap-bench-", dir=scratch_root) as scratch:
        result = bench_transfer(size_list, device=dev, repeats=repeats, root=Path(scratch))
    emit(result, json, render_bench_transfer)


@app.command("slots")
def slots(
    iterations: int = typer.Option(2000, min=10, help="Reserve+release pairs to time."),
    json: bool = JsonOpt,
) -> None:
    """Uncontended slot reserve + release latency (p50/p90/p99), in a scratch slot table on
    /dev/shm (else the temp directory), the tmpfs the real one lives on by default (the
    goal: p50 <= 1 ms)."""
    from spswap.bench.slots import bench_slots, render_bench_slots

    with tempfile.TemporaryDirectory(prefix="spswap-bench-", dir=_shm_or_tmp()) as scratch:
        result = bench_slots(Path(scratch) / "slots", iterations=iterations)
    emit(result, json, render_bench_slots)


@app.command("prolog")
def prolog(
    iterations: int = typer.Option(20, min=1, help="Prolog runs to time."),
    root: Path | None = RootOpt,
    json: bool = JsonOpt,
) -> None:
    """Cost of `spswap node prolog` end to end (a new process each time) while the daemon
    runs (the goal: <= 100 ms). Where none runs on the root, one is started for the runs
    and stopped after them."""
    from spswap.bench.prolog import bench_prolog, render_bench_prolog

    result = bench_prolog(load_config(root), iterations=iterations)
    emit(result, json, render_bench_prolog)


def _vllm_refusal(command: str) -> str | None:
    """What this machine lacks for ``command`` (vLLM, a CUDA GPU or both), or None."""
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:  # (vLLM brings torch: both are said missing)
        gpu = False
    return vllm_gpu_refusal(command, has_vllm=available(), has_gpu=gpu,
                            pip_hint=pip_install_hint("vllm"))  # fmt: skip


def _free_bytes(path: Path) -> int | None:
    try:
        return fs_sizes(path)[1]
    except OSError:
        return None


def _shm_or_tmp() -> str:
    return "/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()


@app.command("swap")
def swap(
    models: list[Path] = typer.Argument(
        ...,
        exists=True,
        file_okay=False,
        help="Model directories (config.json + safetensors), e.g. written by "
        "scripts/gpu/make_models.py.",
    ),
    pool_dir: Path = typer.Option(
        Path("/dev/shm/spswap-bench/pool"), help="Scratch pool for the exported weights."
    ),
    cycles: int = typer.Option(3, min=1, help="spswap sleep+wake cycles per model."),
    max_new_tokens: int = typer.Option(
        DEFAULT_MAX_NEW_TOKENS,
        min=1,
        max=4096,
        help="Greedy tokens per prompt, compared after every swap.",
    ),
    gpu_memory_utilization: float = typer.Option(
        0.4, min=0.01, max=1.0, help="Fraction of the GPU each engine may use."
    ),
    kv_cache_gib: float = typer.Option(
        None,
        min=0.01,
        help="The KV cache's size in GiB (default: what "
        "--gpu-memory-utilization leaves). Every swap path hands it back to the driver "
        "and gets it again, so it is part of every figure.",
    ),
    out: Path = typer.Option(
        None,
        help="Also write the JSON report here, after every model (a cut run keeps "
        "the models done).",
    ),
    pack: bool = typer.Option(False, "--pack", help=PACK_HELP),
    json: bool = JsonOpt,
) -> None:
    """vLLM swap paths side by side on the same model and settings (needs a GPU and vLLM):
    cold start, level-1 sleep+wake, level-2 sleep + wake + reload from disk, spswap
    sleep+wake from the pool, start without disk, and the pinned-copy limit, with the
    greedy outputs after each swap compared to the cold ones. Exits 1 unless every
    output after a swap equals the cold one."""
    if (refusal := _vllm_refusal("bench swap")) is not None:
        raise ConfigError(refusal)

    def save(result: dict[str, Any]) -> None:
        if out is not None:  # (whole or not at all: a run cut while writing keeps the last)
            atomic_write_json(out, result)

    result = bench_swap(list(models), pool_dir=pool_dir, cycles=cycles, pack=pack,
                        max_new_tokens=max_new_tokens, after_model=save,
                        settings=bench_settings(gpu_memory_utilization, kv_cache_gib),
                        log=_progress)  # fmt: skip
    emit(result, json, render_bench_swap)
    if not all(m.get("all_identical") for m in result["models"]):
        raise typer.Exit(1)


@app.command("turns")
def turns(
    models: list[Path] = typer.Argument(
        None,
        exists=True,
        file_okay=False,
        help="Model directories, one job each (default: reference models made from "
        "--presets in the work directory).",
    ),
    presets: str = typer.Option(
        DEFAULT_TURN_PRESETS,
        help="Reference models to make when no MODELS are given: "
        "PRESET@SEED,... (presets: tiny, small, 1g, 4g).",
    ),
    rounds: int = typer.Option(
        3, min=1, help="Rounds of turns after the cold starts; each model takes one turn per round."
    ),
    engine: str = typer.Option("reference", help="reference (CPU or GPU) or vllm."),
    partition: str = typer.Option(
        "low",
        help="The partition the jobs run in (one device "
        "on one node: the jobs must not fit side by side).",
    ),
    gpus: int = typer.Option(
        1,
        min=1,
        help="GPUs per job (--gres=gpu:N); every job must "
        "need the same device for the models to take turns.",
    ),
    work_dir: Path = typer.Option(
        None,
        help="Where the job scripts, logs and state directories go (default: "
        "./spswap-turns-TIME); it must outlive the jobs.",
    ),
    max_new_tokens: int = typer.Option(16, min=1, max=4096, help="Greedy tokens per answer."),
    kv_cache_gib: float = typer.Option(
        None,
        min=0.01,
        help="vLLM: the KV cache's size in GiB (spswap serve --kv-cache-gib).",
    ),
    vllm_args: str = typer.Option(
        "",
        help="vLLM's own options for every job (the template's VLLM_ARGS), e.g. "
        "'--max-num-seqs 8'.",
    ),
    eager: bool = typer.Option(
        False,
        help="(vllm) --eager: no CUDA graphs or compilation, as spswap serve runs by "
        "default (the fastest cold start). This bench's default, --no-eager, measures "
        "vLLM's own default (CUDA graphs and torch.compile).",
    ),
    turn_timeout_s: float = typer.Option(
        600.0, min=1.0, help="How long one turn may take before the bench gives up."
    ),
    time_limit: str = typer.Option("01:00:00", help="Each job's --time."),
    out: Path = typer.Option(None, help="Also write the JSON report to this file."),
    root: Path | None = RootOpt,
    json: bool = JsonOpt,
) -> None:
    """K models take R rounds of turns on one device through the real product: each model
    is `spswap serve` in its own requeueable Slurm job (the template spswap ships),
    submitted held; a turn releases the next model's job and requeues the running one
    held (`scontrol requeuehold`), spswapd parks and dumps it (kept or to an image), and
    the next job's run restores its model and answers. Each model starts once first:
    cold, or from the pool where an earlier run left its weights there. Per turn: the
    path, the seconds from the Slurm action to the first answer split into Slurm's share
    (with the part of it the job waited for Slurm's requeue delay: a requeued job may
    start again only `AuthInfo=cred_expire` + 1 s after its requeue) and spswap's, and
    whether the answer equals the model's first answer. Exits
    1 unless every later turn restored with an identical answer and nothing was left
    behind. Needs Slurm, spswapd and CRIU on the node."""
    import time

    from spswap.bench.turns_report import render_turns

    check_engine_name(engine)
    work = (work_dir or Path.cwd() / f"spswap-turns-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    paths = [p.resolve() for p in models] if models else None
    if paths is None and engine != "reference":  # said before Slurm is asked
        raise ConfigError("--engine vllm needs MODELS: vLLM model directories "
                          "(e.g. written by scripts/gpu/make_models.py)")  # fmt: skip
    slurm_preflight(partition)  # before any model is written
    if paths is None:
        paths = make_reference_models(presets, work / "models")
    serve_args = turns_serve_args(engine, kv_cache_gib, eager)
    opts = TurnsOptions(models=tuple(paths), work_dir=work, rounds=rounds, engine=engine,
                        partition=partition, gpus=gpus, max_new_tokens=max_new_tokens,
                        vllm_args=vllm_args, serve_args=serve_args, time_limit=time_limit,
                        turn_timeout_s=turn_timeout_s)  # fmt: skip
    summary = run_turns(opts, load_config(root), log=_progress)
    if out is not None:
        atomic_write_json(out, summary.to_json())
    emit(summary.to_json() if json else summary, json, render_turns)
    if not summary.ok:
        raise typer.Exit(1)


@app.command("traffic")
def traffic(
    model_counts: str = typer.Option(
        "2,4,6", help="Comma-separated numbers of models served at once on one device."
    ),
    rates: str = typer.Option(
        "30,60",
        help="Comma-separated request rates per minute (all models together; Poisson "
        "arrivals): R for every model count, N:R for N models only (4:64,6:48).",
    ),
    duration_s: float = typer.Option(30.0, min=0.1, help="Seconds of traffic per rate."),
    max_new_tokens: int = typer.Option(8, min=1, help="Greedy tokens per answer."),
    p95_target_s: float = typer.Option(2.0, min=0.0, help="The p95 latency a rate must meet."),
    units: int = typer.Option(
        2, min=1, max=4, help="Quarter units of a device per awake model (2: two awake)."
    ),
    awake: str = typer.Option(
        None,
        help="Comma-separated numbers of models awake at once, run after run on the same "
        "engines (2,1: two-resident, then one-resident); default: as --units allows.",
    ),
    engine: str = typer.Option("reference", help="reference (CPU) or vllm (a GPU)."),
    kv_cache_gib: float = typer.Option(
        None, min=0.01, help="(vllm) Each model's KV cache, GiB (default: its share's rest)."
    ),
    eager: bool = typer.Option(
        True, help="(vllm) No CUDA graphs or compilation (the fastest starts)."
    ),
    max_model_len: int = typer.Option(1024, help="(vllm) Longest prompt + answer, tokens."),
    vllm_args: str = typer.Option(None, help="(vllm) vLLM's own options, one string."),
    preset: str = typer.Option(
        "tiny", help="Reference models made for the run (seeds differ) when no --models are given."
    ),
    models: list[Path] = typer.Option(
        None,
        "--models",
        help="Model directories to serve instead (repeat the flag; the first N are used); "
        "needed with --engine vllm.",
    ),
    check: bool = typer.Option(True, help="Compare every answer with the model's cold answer."),
    out: Path = typer.Option(
        None,
        help="Also write the JSON report here, after every rate (a cut run keeps its "
        'rows), with the last run\'s /metrics text under the key "metrics" (--json leaves '
        "it out).",
    ),
    root: Path = RootOpt,
    json: bool = JsonOpt,
) -> None:
    """Poisson traffic against one multi-model job (`spswap serve --models`) per model
    count: per rate p50/p95/p99 latency, swaps and their latency, failed requests and
    answers that differ from the cold answer, requests per device-hour against one
    device per model, and the highest rate within --p95-target-s. --engine vllm runs on
    the GPU with model directories given by --models (token-id prompts: no tokenizer
    needed), each model's cold answers made at its first start from its files. Exits 1
    when an answer differed from the model's cold answer (failed requests are counted in
    the table: a rate with any is not within the target). Needs torch."""
    if engine == "vllm" and (refusal := _vllm_refusal("bench traffic --engine vllm")):
        raise ConfigError(f"{refusal}; or use --engine reference, which runs on CPU")
    if engine == "reference" and missing_torch_part() is not None:
        raise ConfigError(needs_torch("bench traffic"))
    counts = tuple(int(c) for c in parse_floats(model_counts, "--model-counts", "2,4"))
    every, per = parse_rates(rates)
    check_rates(counts, every, per)
    awake_counts = tuple(int(a) for a in parse_floats(awake, "--awake", "2,1")) if awake else ()
    vllm = model_settings(units, kv_cache_gib=kv_cache_gib, eager=eager,
                          max_model_len=max_model_len) if engine == "vllm" else None  # fmt: skip
    opts = TrafficOptions(model_counts=counts, rates_per_min=every,
                          rates_by_count=tuple(per.items()), duration_s=duration_s,
                          max_new_tokens=max_new_tokens, p95_target_s=p95_target_s,
                          units_per_model=units, preset=preset, models=tuple(models or ()),
                          check=check, engine=engine, vllm=vllm, vllm_args=vllm_args or "",
                          awake=awake_counts, out=out)  # fmt: skip

    result = bench_traffic(load_config(root), opts, log=_progress)
    emit(
        {k: v for k, v in result.items() if k != "metrics"},
        json,
        lambda r: render([RateRow(**row) for row in r["rows"]], r["p95_target_s"]),
    )
    if any(row["wrong"] for row in result["rows"]):
        raise typer.Exit(1)
