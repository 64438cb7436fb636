"""``spswap bench``: side-by-side measurements; docs/benchmarks.md records their output."""

from __future__ import annotations

import tempfile
from pathlib import Path

import typer

from spswap.cli.common import JsonOpt, RootOpt, console, emit, load_config
from spswap.config import parse_size
from spswap.errors import ConfigError

app = typer.Typer(
    help="Benchmarks: transfer throughput, slot reservation latency, prolog cost, vLLM swap paths.",
    no_args_is_help=True,
)

DEFAULT_SIZES = "64M,256M,1G,4G,16G"


def _sizes(text: str) -> list[int]:
    sizes = [parse_size(s) for s in text.split(",") if s.strip()]
    if not sizes:
        raise ConfigError("--sizes needs at least one size, e.g. 64M,1G")
    return sizes


@app.command("transfer")
def transfer(
    sizes: str = typer.Option(
        DEFAULT_SIZES, help="Comma-separated sizes (K/M/G suffixes) of the pool entries to copy."
    ),
    device: str = typer.Option(
        None, help="Target device, e.g. cuda:0 or cpu (default: cuda:0 when present, else cpu)."
    ),
    repeats: int = typer.Option(5, min=1, help="Copies per size and method; the best is kept."),
    root: Path | None = typer.Option(
        None, help="Scratch root for the benchmark's pool (default: a temp dir on /dev/shm)."
    ),
    json: bool = JsonOpt,
) -> None:
    """Pool -> device copy throughput, side by side with a plain pinned-buffer copy (the
    device's limit) and a pageable copy, in the same run; prints each method's GB/s and the
    pool's ratio to the pinned limit."""
    try:
        from spswap.bench.transfer import bench_transfer, render_bench_transfer
    except ImportError as e:  # torch missing
        raise ConfigError(f"bench transfer needs torch ({e}); pip install 'spswap[torch]'") from e
    import torch

    dev = device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(
        prefix="spswap-bench-", dir=root or _shm_or_tmp()
    ) as scratch:
        result = bench_transfer(_sizes(sizes), device=dev, repeats=repeats, root=Path(scratch))
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
    runs (the goal: <= 100 ms)."""
    from spswap.bench.prolog import bench_prolog, render_bench_prolog

    result = bench_prolog(load_config(root), iterations=iterations)
    emit(result, json, render_bench_prolog)


def _shm_or_tmp() -> str:
    return "/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()


@app.command("swap")
def swap(
    models: list[Path] = typer.Argument(
        ..., exists=True, file_okay=False,
        help="Model directories (config.json + safetensors), e.g. written by "
             "scripts/gpu/make_models.py.",
    ),
    pool_dir: Path = typer.Option(
        Path("/dev/shm/spswap-bench/pool"), help="Scratch pool for the exported weights."
    ),
    cycles: int = typer.Option(3, min=1, help="spswap sleep+wake cycles per model."),
    gpu_memory_utilization: float = typer.Option(
        0.4, min=0.01, max=1.0, help="Fraction of the GPU each engine may use."
    ),
    kv_cache_gib: float = typer.Option(
        None, min=0.01, help="The KV cache's size in GiB (default: what "
        "--gpu-memory-utilization leaves). Every swap path hands it back to the driver "
        "and gets it again, so it is part of every figure.",
    ),
    json: bool = JsonOpt,
) -> None:
    """vLLM swap paths side by side on the same model and settings (needs a GPU and vLLM):
    cold start, level-1 sleep+wake, level-2 sleep + wake + reload from disk, spswap
    sleep+wake from the pool, start without disk, and the pinned-copy limit, with the
    greedy outputs after each swap compared to the cold ones."""
    try:
        from spswap.bench.swap import bench_settings, bench_swap, render_bench_swap
        from spswap.engines.vllm_engine import available
    except ImportError as e:
        raise ConfigError(f"bench swap needs torch ({e}); pip install 'spswap[torch,vllm]'") from e
    if not available():
        raise ConfigError("bench swap needs vLLM and a CUDA GPU; pip install 'spswap[vllm]'")
    result = bench_swap(list(models), pool_dir=pool_dir, cycles=cycles,
                        settings=bench_settings(gpu_memory_utilization, kv_cache_gib),
                        log=lambda s: console.print(s, markup=False, soft_wrap=True))  # fmt: skip
    emit(result, json, render_bench_swap)
