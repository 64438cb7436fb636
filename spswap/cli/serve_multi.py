"""``spswap serve --models A B C``: the CLI side of a multi-model job."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from spswap.cli.common import checked_model_dir, emit_json, err_console
from spswap.config import Config
from spswap.engines.model_check import check_servable
from spswap.multi.backend import serve_models
from spswap.multi.engine_settings import model_settings
from spswap.multi.serve import MultiOptions, check_names
from spswap.serve.run_end import models_end_text, stood_in_text


def serve_multi(cfg: Config, job: Any, models: list[Path], state_dir: Path, *, engine: str,
                device: str | None, units: int, awake: int | None,
                vllm: dict[str, Any], vllm_args: str, pack: bool,
                idle_timeout_s: float | None, latency_target_s: float | None,
                swap_s: float | None, port: int | None, host: str, socket: Path | None,
                slot_timeout_s: float, json_out: bool, drain_s: float,
                requeue: Callable[[str], None] | None,
                checkpointer: Callable[[], Any]) -> None:  # fmt: skip
    """Check the model directories, then serve them all until SIGTERM or USR1 (with
    spswapd, a stop of a job that comes back checkpoints all of them, and its next run
    restores them). ``checkpointer``: made after the checks (it forks the instance).
    ``vllm``: ``spswap serve``'s vLLM options (each model's share from ``units``);
    ``pack``: (vLLM, eager) pack each model's weights once up."""
    # A requeued run that may restore its models checks none of them: the check imports
    # torch (seconds), which a restore does not need; the first run checked them.
    may_restore = job is not None and job.restart_count > 0
    paths = [checked_model_dir(m, many=True) for m in models]  # every path, then the models
    check_names(tuple(paths))  # (before the line that says they start)
    if not may_restore:
        for m in paths:
            check_servable(engine, m)
    assert socket is not None
    # a requeued run may restore them rather than start them: its next line says which
    verb = "bringing back" if may_restore else "starting"
    err_console.print(f"spswap serve: {verb} {len(paths)} models (their OpenAI API will "
                      f"be on {socket})",
                      markup=False, soft_wrap=True)  # fmt: skip
    opts = MultiOptions(
        models=tuple(paths), socket_path=socket, state_dir=state_dir, engine=engine,
        device=device or "cpu", units_per_model=units, max_awake=awake,
        slot_gpus=tuple(job.gpus) if job else (), slot_timeout_s=slot_timeout_s,
        idle_timeout_s=idle_timeout_s, latency_target_s=latency_target_s, swap_s=swap_s,
        port=port, host=host, drain_s=drain_s, vllm_args=vllm_args, pack=pack,
        vllm=model_settings(units, **vllm) if engine == "vllm" else None,
    )  # fmt: skip
    summary = serve_models(
        cfg, opts, job_id=job.job_id if job else None,
        restart_count=job.restart_count if job else 0, requeue=requeue,
        checkpointer=checkpointer(),
        log=lambda msg: err_console.print(msg, markup=False, highlight=False, soft_wrap=True),
    )  # fmt: skip
    if json_out:
        emit_json({k: v for k, v in summary.items() if k != "metrics"})
    elif summary.get("restored_pid") is not None:
        text = stood_in_text(summary["restart_count"], summary["restored_pid"], models=True)
        err_console.print(f"spswap serve: {text}", markup=False, soft_wrap=True)
    else:
        text = models_end_text(summary["stopped_by"], summary["answered"], summary["failed"],
                               engines_ended=summary["engines_ended"])  # fmt: skip
        err_console.print(f"spswap serve: {text}", markup=False, soft_wrap=True)
