"""``spswap serve --engine vllm``: the CLI side of one vLLM model's job."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spswap.cli.common import emit_json, err_console
from spswap.config import Config
from spswap.engines.vllm_engine import VllmSettings, kv_cache_bytes
from spswap.serve.run_end import run_end_text
from spswap.serve.vllm_run import VllmServeOptions, vllm_run


def serve_vllm(
    cfg: Config, job: Any, model: Path, state_dir: Path, vllm_args: list[str], *,
    units: int, slot_timeout_s: float, requeue: Callable[[str], None] | None, json_out: bool,
    gpu_memory_utilization: float | None, kv_cache_gib: float | None, max_model_len: int,
    eager: bool, pack: bool,
    port: int | None, host: str, launcher: str | None, drain_s: float,
    checkpointer_marked: Callable[[], tuple[Any, dict[str, float]]],
) -> None:  # fmt: skip
    """Serve ``model`` with vLLM's OpenAI server until a stop, then print how the run
    ended. ``checkpointer_marked``: the run's checkpointer and its first marks, made
    after the settings are checked (it forks the instance)."""
    if gpu_memory_utilization is None:
        gpu_memory_utilization = round(0.9 * units / 4, 3)
    settings = VllmSettings(gpu_memory_utilization=gpu_memory_utilization,
                            kv_cache_memory_bytes=kv_cache_bytes(kv_cache_gib),
                            max_model_len=max_model_len,
                            enforce_eager=eager)  # fmt: skip
    opts = VllmServeOptions(
        model=model, state_dir=state_dir, settings=settings, vllm_args=tuple(vllm_args),
        units=units, slot_gpus=tuple(job.gpus) if job else (), slot_timeout_s=slot_timeout_s,
        http_port=port, http_host=host, launcher=tuple(shlex.split(launcher or "")),
        drain_s=drain_s, pack=pack,
    )  # fmt: skip
    checkpointer, marks_s = checkpointer_marked()
    run = vllm_run(
        cfg, opts, job_id=job.job_id if job else None,
        restart_count=job.restart_count if job else 0,
        requeue=requeue,
        log=lambda msg: err_console.print(msg, markup=False, highlight=False, soft_wrap=True),
        checkpointer=checkpointer,
    )  # fmt: skip
    run.marks_s.update(marks_s)
    run.install_signal_handlers()
    result = run.run()
    if json_out:
        emit_json({**result.to_json(), "state_dir": str(state_dir)})
    else:
        err_console.print(f"spswap serve: {run_end_text(result, state_dir, spool=False)}",
                          markup=False)  # fmt: skip
