"""``spswap serve --models A B C``: one job, one endpoint, several models.

The run: import each model into the pool (the first time), start one engine process per
model from the pool, put all but the awake slots to sleep, check the swap budget, then
serve on the private socket (and TCP with the key) until SIGTERM or USR1. Preemption of
the whole job (park, checkpoint, replay the queues) is not done yet: a stop answers the
queued requests with an error and ends every engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spswap.access import PoolAccess
from spswap.config import Config
from spswap.errors import ConfigError, StopRequested
from spswap.multi.http_api import ApiServer
from spswap.multi.placement import awake_slots, budget_refusal
from spswap.multi.procs import ModelSpec
from spswap.multi.records import ModelRecords
from spswap.multi.router import Router
from spswap.multi.worker import make_engine
from spswap.serve.http_front import HttpFront, new_key
from spswap.serve.slot_hold import RunSlot, StopSignals


@dataclass(frozen=True)
class MultiOptions:
    """What ``spswap serve --models`` was asked to do."""

    models: tuple[Path, ...]
    socket_path: Path
    state_dir: Path
    engine: str = "reference"
    device: str = "cpu"
    units_per_model: int = 2  # quarter units of a device per awake model
    devices: int = 1  # the models share one device (the job's first GPU)
    slot_gpus: tuple[int, ...] = ()  # the job's GPUs (slot table indexes); none: no slot
    slot_timeout_s: float = 600.0
    max_awake: int | None = None
    idle_timeout_s: float | None = None
    latency_target_s: float | None = None
    swap_s: float | None = None  # the budget's swap estimate; None: measured at start
    port: int | None = None
    host: str = "127.0.0.1"


def import_models(cfg: Config, paths: tuple[Path, ...], job_id: str | None) -> list[ModelSpec]:
    """Each model in the pool (read from disk the first time); its spec."""
    if len(paths) < 1:
        raise ConfigError("--models needs at least one model directory")
    names = [p.name for p in paths]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"more than one model directory is named {', '.join(twice)}: "
                          "requests name a model by its directory's name; rename one")  # fmt: skip
    pool = PoolAccess(cfg, job_id=job_id)
    return [ModelSpec(p.name, p, pool.import_checkpoint(p).digest) for p in paths]


def start_router(cfg: Config, opts: MultiOptions, *, job_id: str | None = None,
                 log: Callable[[str], None] = print,
                 on_state: Callable[[str, bool], None] | None = None) -> Router:  # fmt: skip
    """The router with every model started and the swap budget checked (a refused set
    ends its engines and raises ConfigError with the reason)."""
    if opts.engine != "reference":  # before any model is read into the pool
        make_engine(opts.engine, opts.models[0], opts.device, opts.models[0].name)
    specs = import_models(cfg, opts.models, job_id)
    slots = awake_slots(len(specs), opts.units_per_model, opts.devices, opts.max_awake)
    router = Router(specs, slots=slots, engine=opts.engine, device=opts.device,
                    root=cfg.root, job_id=job_id, idle_timeout_s=opts.idle_timeout_s,
                    log=log, on_state=on_state)  # fmt: skip
    router.start()
    if opts.latency_target_s is not None:
        swap_s = opts.swap_s if opts.swap_s is not None else router.measure_swap_s()
        refusal = budget_refusal(len(specs), slots, opts.latency_target_s, swap_s)
        if refusal is not None:
            router.close()
            raise ConfigError(refusal)
        log(
            f"spswap serve: swap budget met ({len(specs)} models, {slots} awake, "
            f"swap {swap_s:.3f} s, target {opts.latency_target_s:g} s)"
        )
    return router


def serve_models(cfg: Config, opts: MultiOptions, *, job_id: str | None = None,
                 log: Callable[[str], None] = print,
                 stop: threading.Event | None = None) -> dict[str, Any]:  # fmt: skip
    """Reserve the job's share of its GPU, then serve until SIGTERM/USR1 (or ``stop``
    is set); returns a summary."""
    n_awake = awake_slots(len(opts.models), opts.units_per_model, opts.devices, opts.max_awake)
    # the job's share of its GPU on the node's slot table: its awake models' units
    slot = RunSlot(cfg, model="+".join(p.name for p in opts.models),
                   units=min(4, n_awake * opts.units_per_model), gpus=opts.slot_gpus,
                   job_id=job_id, timeout_s=opts.slot_timeout_s)  # fmt: skip
    signals = StopSignals(slot)
    if stop is not None:
        signals.stop_event = stop
    if threading.current_thread() is threading.main_thread():
        signals.install_signal_handlers()
    try:
        slot.reserve(signals.stop_signal)
    except StopRequested as e:
        log(f"spswap serve: {e}")
        return {"models": [p.name for p in opts.models], "stopped_by": signals.stop_signal}
    try:
        return _serve_reserved(cfg, opts, signals, job_id=job_id, log=log)
    finally:
        slot.release()


def _serve_reserved(cfg: Config, opts: MultiOptions, signals: Any, *, job_id: str | None,
                    log: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip

    opts.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    records = ModelRecords(cfg.paths.run, job_id=job_id, engine=opts.engine,
                           device=opts.device, log=log)  # fmt: skip
    try:
        router = start_router(cfg, opts, job_id=job_id, log=log, on_state=records.update)
    except BaseException:
        records.remove_all()
        raise
    api = ApiServer(router, opts.socket_path)
    front = None
    try:
        api.start()
        log(
            f"spswap serve: {len(router.specs)} models on {opts.socket_path} "
            f"({router.placement.slots} awake at once)"
        )
        if opts.port is not None:
            key = new_key(opts.state_dir / "api_key")
            front = HttpFront(opts.socket_path, key, opts.host, opts.port)
            log(
                f"spswap serve: also on {opts.host}:{front.start()} with the key in "
                f"{opts.state_dir / 'api_key'}"
            )
        signals.stop_event.wait()
    finally:
        if front is not None:
            front.stop()
        api.stop()
        router.close()
        records.remove_all()
    return {
        "models": list(router.specs),
        "stopped_by": signals.stop_signal,
        "metrics": router.metrics_text(),
    }
